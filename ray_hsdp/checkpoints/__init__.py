"""Writers of local diffusers folders: the embedded tiny pipeline and real-size random checkpoints.

Layer: Beside ``loading`` (it writes what ``loading`` reads, and quantizes through its steps): may
import loading, sharding, config and the shared modules."""
