"""Any other client: no normalisation extras, no declared cuts (the planner keeps every turn boundary)."""
from __future__ import annotations

from typing import Any, Mapping, Optional

from harness_adapters.base import BaseAdapter
from proxy.conversation import Conversation


class GenericAdapter(BaseAdapter):
    name = "generic"

    def detect(self, request: Mapping[str, Any], headers: Mapping[str, str],
               conv: Optional[Conversation] = None) -> bool:
        return True
