"""Workload serving: ``polyinf serve-workload NAME``, one non-LLM workload over HTTP with hot swaps."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

EPILOG = """\
request body (POST /v1/workloads/NAME/infer), one of:

  {"inputs": {"<tensor>": {"shape": [...], "data": [flat row-major numbers]}}, "size": N}
      explicit inputs, named as the model takes them for one request; "size" is optional (it is read off the
      shapes). GET /v1/workloads?size=N lists the names, shapes and dtypes a request of size N sends.
  {"size": N, "seed": S}
      inputs drawn by the workload's own generator (for load tests): the same N and S give the same inputs.

answer: {"id", "workload", "variant_id", "outputs": {"shape", "data"}, "latency_ms", "batch_size"}

example (patchtst: a request of 2 series of 336 hourly samples each):

  polyinf serve-workload patchtst --port 8100 --admin-token secret &
  curl -s 'localhost:8100/v1/workloads?size=2'
  curl -s localhost:8100/v1/workloads/patchtst/infer -H 'Content-Type: application/json' \\
       -d '{"size": 2, "seed": 7}'
  python -c 'import json; print(json.dumps({"inputs": {"series": {"shape": [1, 336], "data": [0.5] * 336}}}))' |
    curl -s localhost:8100/v1/workloads/patchtst/infer -H 'Content-Type: application/json' -d @-

admin (bearer token): GET /admin/variant; POST /admin/variant with a WorkloadVariant JSON, e.g.
  curl -s localhost:8100/admin/variant -H 'Authorization: Bearer secret' -d '{"name": "b4", "max_batch": 4}'
(a variant that changes precision, e.g. "matmul_precision": "bf16", needs "gate": "tolerance" in the body);
POST /admin/rollback.
"""


def load_variant(text: str | None):
    """``--variant``: inline JSON or a JSON file, as ``WorkloadVariant.to_json`` writes it (None: static-best)."""
    if text is None:
        return None
    from engine.entrypoints.openai_protocol import APIError
    from engine.entrypoints.workload_protocol import variant_from_json
    from engine.errors import ConfigError

    raw = text if text.lstrip().startswith("{") else None
    if raw is None:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--variant must be a JSON object or a JSON file; no file {text!r}")
        raw = path.read_text()
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"--variant is not valid JSON: {e}") from None
    try:
        return variant_from_json(body)[0]
    except APIError as e:
        raise ConfigError(f"--variant: {e.message}") from None


def cmd_serve_workload(args: argparse.Namespace) -> int:
    from engine.errors import ConfigError
    from engine.workloads import get_workload

    try:
        get_workload(args.name)
        variant = load_variant(args.variant)
        from engine.entrypoints.workload_server import serve_workload

        serve_workload(args.name, host=args.host, port=args.port, device=args.device, variant=variant,
                       admin_token=args.admin_token, api_key=args.api_key, log_level=args.log_level,
                       max_queue=args.max_queue, max_body_bytes=args.max_body_mb * 1024**2)
    except ValueError as e:  # an unknown workload, a variant refused on this device
        raise ConfigError(str(e)) from None
    return 0


def add_parsers(sub) -> None:
    from pipelines.cli.args import positive

    sw = sub.add_parser("serve-workload", help="serve a non-LLM workload (fno, weather_gnn, protein_e3nn, patchtst) "
                                               "over HTTP: JSON requests batched by its policy, hot-swapped variants",
                        description="Serve one non-LLM workload: its model is built once on --device; requests\n"
                                    "that arrive together share forward passes as its batch policy allows;\n"
                                    "/admin/variant swaps the variant between two batches (never the weights).",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sw.add_argument("name", metavar="NAME", help="the workload: fno, weather_gnn, protein_e3nn or patchtst")
    sw.add_argument("--host", default="127.0.0.1")
    sw.add_argument("--port", type=int, default=8000)
    sw.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    sw.add_argument("--variant", default=None,
                    help="a WorkloadVariant as inline JSON or a JSON file, e.g. '{\"name\": \"eager\"}' (default: "
                         "the workload's static-best on the device)")
    sw.add_argument("--admin-token", default=None,
                    help="bearer token for /admin endpoints (default: $POLYINF_ADMIN_TOKEN; none disables them)")
    sw.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer <key>' on /v1 (default: $POLYINF_API_KEY; none: open)")
    sw.add_argument("--max-queue", type=positive, default=256, help="requests queued before new ones get a 503")
    sw.add_argument("--max-body-mb", type=positive, default=64, help="largest request body (larger: 413)")
    sw.add_argument("--log-level", default="warning")
    sw.set_defaults(func=cmd_serve_workload)
