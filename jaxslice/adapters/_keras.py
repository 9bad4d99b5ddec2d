"""Work in progress."""

from __future__ import annotations

from ._base import Adapter


class KerasAdapter(Adapter):
    model_class = ('keras', 'Layer')
