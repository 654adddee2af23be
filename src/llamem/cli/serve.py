"""`llamem serve`: the local web page (see `llamem.web` and docs/web.md)."""

from __future__ import annotations

import click


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on: the default answers this machine only; 0.0.0.0 opens it to the network.")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port (0: any free port).")
def serve(host, port):
    """A local page: pick a model, a task and a GPU; see the breakdown per phase, the plan, the cards it
    fits on, and the commands, live. Its JSON API answers what `--json` prints."""
    from llamem.web.server import make_server

    server = make_server(host, port)
    click.echo(f"llamem serve: http://{_shown_host(host)}:{server.server_address[1]}/  (Ctrl-C stops it)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _shown_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
