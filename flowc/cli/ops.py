"""`flowc ops`: the ops flowc supports, by family."""

from __future__ import annotations

import click

from flowc.cli.common import out


@click.command(name="ops", short_help="List the supported ops, by family.")
def ops() -> None:
    """List the supported ops, by family."""
    from flowc.ops.registry import all_ops

    families: dict[str, list[str]] = {}
    for op in all_ops():
        families.setdefault(op.family, []).append(op.name)
    for fam in sorted(families):
        out.print(f"[bold]{fam}[/] ({len(families[fam])}): " + " ".join(families[fam]))
    out.print(f"{sum(len(v) for v in families.values())} ops with kernels or import lowerings")
    from flowc.frontend.onnx_control import CONTROL_OPS
    from flowc.frontend.onnx_functions import expandable_ops

    known = {op.name for op in all_ops()} | set(CONTROL_OPS)
    funcs = expandable_ops(known)
    out.print(
        f"[bold]control flow[/] ({len(CONTROL_OPS)}, resolved at import: known conditions, "
        "unrolled loops): " + " ".join(CONTROL_OPS)
    )
    out.print(
        f"[bold]function ops[/] ({len(funcs)}, imported through their ONNX function body): "
        + " ".join(funcs)
    )
