"""A search's picture (search.svg): the dev score of every trial against its settings, a point
per seed and a bar at each setting's median, the winner ringed. Plain SVG written here, so a run
needs no plotting library and any browser shows it."""

from __future__ import annotations

import html
import math

WIDTH, HEIGHT = 720, 360
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 32, 96


def _label(settings: dict, varied: list[str]) -> str:
  short = {"learning_rate": "lr", "num_epochs": "ep", "warmup_proportion": "wu",
           "weight_decay": "wd", "batch_size": "bs"}
  return " ".join(f"{short.get(k, k)} {settings[k]:g}" for k in varied) or "one setting"


def search_picture(summary: dict) -> str:
  """The SVG text of `summary` (search.summarise)."""
  settings = sorted(summary["settings"], key=lambda e: [e["settings"][k]
                                                         for k in sorted(e["settings"])])
  keys = sorted(settings[0]["settings"]) if settings else []
  varied = [k for k in keys if len({e["settings"][k] for e in settings}) > 1]
  scores = [x for e in settings for x in e["scores"] if math.isfinite(x)]
  low, high = (min(scores), max(scores)) if scores else (0.0, 1.0)
  if high - low < 1e-9:
    low, high = low - 0.5, high + 0.5
  pad = 0.08 * (high - low)
  low, high = low - pad, high + pad
  plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

  def y(v):
    return TOP + plot_h * (1 - (v - low) / (high - low))

  step = plot_w / max(len(settings), 1)
  winner = summary["winner"]["index"]
  out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
         'font-family="sans-serif" font-size="11">',
         f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
         f'<text x="{LEFT}" y="18" font-size="13">dev {html.escape(summary["main_metric"])} '
         'of each trial (a point per seed, a bar at the median; the winner ringed)</text>',
         f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>',
         f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" '
         'stroke="black"/>']
  for k in range(5):
    v = low + (high - low) * k / 4
    out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.3f}</text>')
    out.append(f'<line x1="{LEFT}" y1="{y(v):.1f}" x2="{LEFT + plot_w}" y2="{y(v):.1f}" '
               'stroke="#ddd"/>')
  for i, entry in enumerate(settings):
    cx = LEFT + step * (i + 0.5)
    label = html.escape(_label(entry["settings"], varied))
    out.append(f'<text transform="translate({cx:.1f},{TOP + plot_h + 12}) rotate(30)">'
               f'{label}</text>')
    if entry["median"] is not None:
      out.append(f'<line x1="{cx - step * 0.3:.1f}" y1="{y(entry["median"]):.1f}" '
                 f'x2="{cx + step * 0.3:.1f}" y2="{y(entry["median"]):.1f}" stroke="#c33" '
                 'stroke-width="2"/>')
    for score, seed, trial in zip(entry["scores"], entry["seeds"], entry["trials"]):
      if not math.isfinite(score):
        out.append(f'<text x="{cx:.1f}" y="{TOP + 10}" text-anchor="middle">diverged '
                   f'(seed {seed})</text>')
        continue
      out.append(f'<circle cx="{cx:.1f}" cy="{y(score):.1f}" r="3" fill="#36c">'
                 f'<title>seed {seed}: {score:.4f}</title></circle>')
      if trial == winner:
        out.append(f'<circle cx="{cx:.1f}" cy="{y(score):.1f}" r="7" fill="none" '
                   'stroke="#c33" stroke-width="1.5"/>')
  out.append("</svg>")
  return "\n".join(out) + "\n"
