"""`qualify diagnose`: where a candidate case first leaves its bounds, layer by layer (thin over qualify.diagnose.stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from qualify.cli.options import Format, FormatOpt, RunDirArg

NAME = "diagnose"
HELP = ("Compare a candidate case with the reference layer by layer at step 1 (every decoder layer's modules and the "
        "final norm in the forward, gradients by layer) against the frozen layer bounds, and name the first layer "
        "and tensor out of bound. Exit 1 when one is.")
EPILOG = ("Examples:  qualify diagnose runs/tiny-qwen3 --case torch-tp-fp32-tp2-actor  |  "
          "qualify diagnose runs/tiny-qwen3 --case torch-tp-fp32-tp1-actor --format json --out diagnosis.json")


def main(
    run_dir: RunDirArg,
    case: Annotated[str, typer.Option("--case", help="The candidate case to diagnose (a name from the verdict).",
                                      show_default=False)],
    out: Annotated[Path | None, typer.Option("--out", help="Also write the diagnosis (JSON) to this file.")] = None,
    format: FormatOpt = Format.text,
) -> None:
    from qualify.cli.render import echo_json
    from qualify.diagnose.stage import diagnose
    from qualify.errors import QualifyError

    if out is not None and not out.parent.is_dir():
        raise QualifyError(f"--out {out}: directory {out.parent} does not exist")
    doc = diagnose(run_dir, case)
    if out is not None:
        from qualify.store import write_json

        write_json(out, doc)
    if format is Format.json:
        echo_json(doc)
    else:
        render_text(doc)
    raise typer.Exit(0 if doc["passed"] else 1)


def departure_line(d: dict[str, Any]) -> str:
    where = f"layer {d['layer']}" if d["layer"].isdigit() else d["layer"]
    line = (f"{where}, {d['key']} ({d['phase']}): {d['metric']} {float(d['value']):.3g} > bound {float(d['bound']):.3g}"
            f" ({float(d['ratio']):.3g}x){' ' + d['note'] if d.get('note') else ''}")
    detail = d.get("detail")
    if detail:
        line += (f"; worst parameter {detail['tensor']} {detail['metric']} {float(detail['value']):.3g} "
                 f"(bound {float(detail['bound']):.3g})")
    return line


def render_text(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    console.print(f"[bold]{doc['case']}[/bold]: engine {doc['engine']}, {doc['role']}, {doc['precision']}, "
                  f"TP{doc['tp']}, step {doc['step'] + 1}" + ("" if doc["layer_outputs_hook"] else
                                                             " (the engine has no layer_outputs hook: gradients only)"))
    for family, fam in doc["families"].items():
        table = Table(title=f"vs {fam['reference_run']} [{family}]", title_justify="left")
        for col in ("layer", "tensor", "metric", "value", "bound", "value/bound", ""):
            table.add_column(col, justify="right" if col in ("value", "bound", "value/bound") else "left")
        worst: dict[str, dict[str, Any]] = {}
        for row in fam["rows"]:  # computation order; the worst metric of each tensor
            if row["key"] not in worst or float(row["ratio"]) > float(worst[row["key"]]["ratio"]):
                worst[row["key"]] = row
        for row in worst.values():
            table.add_row(row["layer"], row["key"], row["metric"], f"{float(row['value']):.3g}",
                          f"{float(row['bound']):.3g}", f"{float(row['ratio']):.3g}",
                          "ok" if row["passed"] else f"[red]OUT[/red] {row['note']}".rstrip())
        console.print(table)
        first = fam["first_departure"]
        if first:
            console.print(f"first departure: {departure_line(first)}")
        else:
            near = fam.get("closest")
            console.print("every layer within bound" + (f" (nearest: {near['key']} {near['metric']} at "
                                                         f"{float(near['ratio']):.3g} of its bound)" if near else ""))
