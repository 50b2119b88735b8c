"""A package, so that the ``server`` fixture of its conftest (package scope) stops after its last
test: in a folder without ``__init__.py`` pytest tears a package-scoped fixture down only at the
end of the session, and the shared server idled through the rest of the suite."""
