"""A report as a list of blocks, rendered twice from the same list: a self-contained
index.html (inline CSS, figures as base64 PNG data URIs) and report.md (figures linked from
figures/), so both always say the same.

    blocks = [Heading(1, "Title"), Text("..."), Table(headers, rows), Image(name, title, caption, fig)]
    files = write_document(Path("runs/x"), blocks)

Figures are matplotlib Figures until written: rendering a PNG costs ~0.1-0.5 s each.
"""
from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servelab.atomic import write_atomic
from servelab.reports import plots


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: list[str]


@dataclass(frozen=True)
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Image:
    name: str
    title: str
    caption: str
    figure: Any
    """A matplotlib Figure, rendered to PNG only when the report is written."""


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    markdown: Path
    figures: list[Path]


def write_document(out_dir: Path, blocks: Sequence) -> ReportFiles:
    """Write out_dir/index.html, out_dir/report.md and the figures (out_dir/figures/*.png,
    stale ones removed), each file atomically."""
    out_dir = Path(out_dir)
    pngs = {b.name: plots.png_bytes(b.figure) for b in blocks if isinstance(b, Image)}
    fig_dir = out_dir / "figures"
    fig_dir.mkdir(exist_ok=True)
    for stale in fig_dir.glob("*.png"):
        stale.unlink()
    for name, png in pngs.items():
        write_atomic(fig_dir / f"{name}.png", png)
    write_atomic(out_dir / "report.md", render_markdown(blocks))
    write_atomic(out_dir / "index.html", render_html(blocks, pngs))
    return ReportFiles(out_dir / "index.html", out_dir / "report.md",
                       [fig_dir / f"{name}.png" for name in pngs])


# --------------------------------------------------------------------------- rendering
def render_markdown(blocks: Sequence) -> str:
    out = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"{'#' * b.level} {b.text}")
        elif isinstance(b, Text):
            out.append(b.text)
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {item}" for item in b.items))
        elif isinstance(b, Table):
            cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
            lines = ["| " + " | ".join(map(cell, b.headers)) + " |",
                     "|" + "|".join("---" if i == 0 else "---:" for i in range(len(b.headers))) + "|"]
            lines += ["| " + " | ".join(map(cell, row)) + " |" for row in b.rows]
            out.append("\n".join(lines))
        elif isinstance(b, Image):
            out.append(f"![{b.title}](figures/{b.name}.png)\n\n*{b.caption}*")
    return "\n\n".join(out) + "\n"


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1280px;margin:2em auto;
padding:0 1.2em;color:#222;line-height:1.5}
h1{font-size:1.7em;border-bottom:2px solid #ddd;padding-bottom:.3em}h2{margin-top:2em;font-size:1.3em}
table{border-collapse:collapse;margin:1em 0;font-size:.88em}
th,td{border:1px solid #d4d4d4;padding:4px 8px}th{background:#f4f4f4;text-align:center}
td{text-align:right;font-variant-numeric:tabular-nums}td:first-child{text-align:left;white-space:nowrap}
tr:nth-child(even) td{background:#fafafa}
figure{margin:1.5em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:.92em;margin-top:.4em}
.dot{display:inline-block;width:.8em;height:.8em;border-radius:50%;margin-right:.35em;vertical-align:middle}
"""


def render_html(blocks: Sequence, pngs: Mapping[str, bytes]) -> str:
    """One self-contained page: inline CSS, figures as base64 PNG data URIs (pngs[name])."""
    colours = plots.policy_colours(
        row[0] for b in blocks if isinstance(b, Table) and b.headers[0] == "Policy" for row in b.rows)
    esc = html.escape
    body = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{esc(b.text)}</h{b.level}>")
        elif isinstance(b, Text):
            body.append(f"<p>{esc(b.text)}</p>")
        elif isinstance(b, Bullets):
            body.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{esc(h)}</th>" for h in b.headers)
            rows = []
            for row in b.rows:
                first = esc(row[0])
                if b.headers[0] == "Policy" and row[0] in colours:
                    first = f'<span class="dot" style="background:{colours[row[0]]}"></span>{first}'
                cells = "".join(f"<td>{esc(c)}</td>" for c in row[1:])
                rows.append(f"<tr><td>{first}</td>{cells}</tr>")
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
        elif isinstance(b, Image):
            data = base64.b64encode(pngs[b.name]).decode("ascii")
            body.append(f'<figure id="{esc(b.name)}"><img alt="{esc(b.title)}" '
                        f'src="data:image/png;base64,{data}"><figcaption><b>{esc(b.title)}.</b> '
                        f"{esc(b.caption)}</figcaption></figure>")
    title = next((b.text for b in blocks if isinstance(b, Heading)), "servelab report")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")
