"""A self-contained HTML page: inline CSS, PNGs as base64 data URIs, no script, no network.

Shared by the run report and the eval suite's chart page. The layout is fixed-width (two
~600 px charts per row) so the page looks the same in any browser and when rendered headless
to a screenshot.
"""

from __future__ import annotations

import base64
import html

PAGE_WIDTH_PX = 1240

_CSS = f"""
body {{ font-family: -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif;
  color: #1f2328; background: #fff; margin: 0; }}
main {{ width: {PAGE_WIDTH_PX}px; margin: 0 auto; padding: 20px 16px 40px; }}
h1 {{ font-size: 22px; margin: 4px 0 2px; }}
h2 {{ font-size: 16px; margin: 26px 0 8px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }}
p.sub {{ color: #59636e; font-size: 13px; margin: 0 0 12px; }}
table {{ border-collapse: collapse; font-size: 12.5px; margin: 6px 0; }}
th, td {{ border: 1px solid #d0d7de; padding: 4px 8px; text-align: right; vertical-align: top; }}
th {{ background: #f6f8fa; }}
td.l, th.l {{ text-align: left; }}
.grid {{ display: grid; grid-template-columns: repeat(2, 600px); gap: 14px 24px; }}
figure {{ margin: 0; width: 600px; }}
figure img {{ width: 594px; border: 1px solid #eaeef2; }}
figcaption {{ font-size: 12px; color: #59636e; margin-top: 3px; }}
.swatch {{ display: inline-block; width: 11px; height: 11px; margin-right: 6px;
  vertical-align: -1px; border-radius: 2px; }}
ul.notes {{ font-size: 12.5px; color: #59636e; }}
code {{ font-size: 12px; }}
"""


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def figure(png: bytes, *, alt: str, caption: str = "", width: int = 594) -> str:
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    style = f' style="width:{width}px"' if width != 594 else ""
    return (
        f'<figure{style}><img src="{data_uri(png)}" alt="{esc(alt)}" width="{width}"{style}>'
        f"{cap}</figure>"
    )


def table(head: list[str], rows: list[list[str]], *, left: int = 1) -> str:
    """An HTML table; cells are escaped here. The first `left` columns are left-aligned
    (labels), the rest right-aligned (numbers). A cell given as ("raw", html) is not escaped."""

    def cell(tag: str, i: int, v) -> str:
        cls = ' class="l"' if i < left else ""
        text = v[1] if isinstance(v, tuple) and v[0] == "raw" else esc(v)
        return f"<{tag}{cls}>{text}</{tag}>"

    out = ["<table><tr>" + "".join(cell("th", i, h) for i, h in enumerate(head)) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def swatch(color_hex: str) -> str:
    return f'<span class="swatch" style="background:{esc(color_hex)}"></span>'


def page(title: str, body: str, *, subtitle: str = "") -> str:
    sub = f'<p class="sub">{esc(subtitle)}</p>' if subtitle else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{_CSS}</style></head>\n"
        f"<body><main><h1>{esc(title)}</h1>{sub}\n{body}\n</main></body></html>\n"
    )


def fmt(value, digits: int = 4) -> str:
    """A number for a table cell ('—' when absent)."""
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    if value != value:  # NaN
        return "—"
    return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:,.0f}"
