"""Any other client: no normalisation extras, no declared cuts (the planner keeps every turn boundary)."""
from __future__ import annotations

from typing import Any, Mapping

from harness_adapters.base import BaseAdapter


class GenericAdapter(BaseAdapter):
    name = "generic"

    def detect(self, request: Mapping[str, Any], headers: Mapping[str, str]) -> bool:
        return True
