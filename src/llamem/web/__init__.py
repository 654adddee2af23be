"""`llamem serve`: a local page over the same code as the command line.

`api` turns a request into the command line it stands for and runs it in-process, so the JSON
answered is the JSON `--json` prints; `fits` sizes the workload on every card of the catalog;
`bundle` builds `--emit`'s files in memory; `server` is the HTTP layer (standard library only).
The page itself is in `static/` (no build step, no external reference).
"""
