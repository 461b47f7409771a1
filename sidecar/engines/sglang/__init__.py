"""The SGLang engine: the sidecar's adapter and the loader that runs inside SGLang's processes
(their modules and processes: DESIGN.md's map)."""
