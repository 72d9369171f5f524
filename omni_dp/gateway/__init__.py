"""Fleet gateways that `omni-dp launch --register URL` hands replicas to: the small Gateway
protocol every one implements (base.py) and the SGLang model gateway (sglang.py).

Import-light and torch-free: the launcher imports this on its way up. Talks HTTP only.
"""

from omni_dp.gateway.base import DisablingGateway, Gateway, GatewayError, GatewayWorker
from omni_dp.gateway.sglang import SglangGateway, normalize_url

__all__ = [
    "DisablingGateway",
    "Gateway",
    "GatewayError",
    "GatewayWorker",
    "SglangGateway",
    "normalize_url",
]
