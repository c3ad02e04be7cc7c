"""A PNG contact sheet of generated clients, to look at the styles."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from fedvl.data.offline.imageops import SIZE


def save_preview(
    data: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    path: str,
    per_client: int = 10,
) -> None:
    """Write a PNG grid: one row per client, its first `per_client` train images with labels."""
    scale, label_w, cap_h, pad = 3, 150, 12, 4
    tile = SIZE * scale
    rows = list(data.items())
    width = label_w + per_client * (tile + pad)
    height = max(1, len(rows)) * (tile + cap_h + pad) + pad
    sheet = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for r, (name, split) in enumerate(rows):
        x_train, y_train = split[0], split[1]
        top = pad + r * (tile + cap_h + pad)
        draw.text((4, top + tile // 2 - 6), name, fill=(0, 0, 0), font=font)
        for c in range(min(per_client, len(x_train))):
            left = label_w + c * (tile + pad)
            img = Image.fromarray(np.asarray(x_train[c], dtype=np.uint8), "RGB")
            sheet.paste(img.resize((tile, tile), Image.Resampling.NEAREST), (left, top))
            draw.text(
                (left + tile // 2 - 3, top + tile),
                str(int(y_train[c])),
                fill=(200, 0, 0),
                font=font,
            )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path, format="PNG")
