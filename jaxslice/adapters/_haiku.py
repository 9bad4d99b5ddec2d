"""Work in progress."""

from __future__ import annotations

from ._base import Adapter


class HaikuAdapter(Adapter):
    model_class = ('haiku', 'Transformed')
