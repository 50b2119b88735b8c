"""The notebooks run top to bottom against the test session's cluster: two nodes of real raylets
(``ray.cluster_utils.Cluster``), which the kernels attach to through ``RAY_ADDRESS``."""

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOK = NOTEBOOKS / "quickstart.ipynb"


def run_notebook(path: Path, tmp_path: Path):
    """Executes ``path``; returns the notebook and the text of its outputs."""
    from ray import serve

    nb = nbformat.read(path, as_version=4)
    try:
        client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        serve.shutdown()  # the kernel's Serve (its HTTP port) would outlive it on the shared cluster
    outputs = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    return nb, outputs


def test_quickstart_notebook_runs(ray_cluster, tmp_path):
    # The kernel inherits RAY_ADDRESS from this process, so the notebook attaches to the session's cluster.
    nb, outputs = run_notebook(NOTEBOOK, tmp_path)
    # One request per rank (which rank gets which depends on the order they arrive in).
    ran = set(re.findall(r"rank (\d): seed (\d), \(64, 64\)", outputs))
    assert {rank for rank, _ in ran} == {"0", "1"} and {seed for _, seed in ran} == {"0", "1"}, outputs
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the notebook shows the generated image"
    assert "completed: 9 frames at 16 fps, 64x64" in outputs
    assert "animated: 9 frames from the first image, 64x64" in outputs  # the tiny image-to-video model
    videos = [
        o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", []) if "text/html" in o.get("data", {})
    ]
    assert any("<video" in html and "data:video/mp4;base64," in html for html in videos), "the notebook plays the video"


def test_cluster_notebook_places_each_group_on_one_node(ray_cluster, tmp_path):
    nb, outputs = run_notebook(NOTEBOOKS / "cluster.ipynb", tmp_path)
    assert outputs.count(" CPUs, 0 GPUs") == 2, outputs  # both nodes of the cluster
    placed = re.findall(r"group \w+: ranks on \[(.*?)\]", outputs)
    assert len(placed) == 2, outputs
    for ranks in placed:
        assert len(set(ranks.split(", "))) == 1, ranks  # a group never spans nodes
    assert "2 groups, each on one node" in outputs
    assert "8 images of (64, 64)" in outputs
    assert outputs.count("replica ") == 2 and "2 lanes of 1" in outputs
    assert "groups by state: {'RUNNING': 2}" in outputs and "each group: ['serving', 'serving']" in outputs
    assert "'autoscaling': {'min_groups': 1, 'max_groups': 4" in outputs
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
