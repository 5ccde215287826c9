"""An OpenAI-compatible endpoint on the engine, with exact token capture, and rollout functions
written against the ``openai`` client (``endpoint.rollout``).

- ``protocol``: the wire format (requests checked, responses built from the ``openai`` types);
- ``capture``: a session's calls token-in token-out, and the trajectory they make;
- ``server``: the FastAPI app and the driver that batches its calls onto the engine;
- ``rollouts``: rollout functions as the run's rollouts (``EndpointLoop``);
- ``verifiers``: the built-in rollout function ``verifiers`` (episodes of a verifiers taskset, in
  its own venv through ``verifiers_worker.py``).
"""

from .capture import Node, Session
from .rollouts import (ENDPOINT_ENV, ROLLOUT_FUNCTIONS, EndpointConfig, EndpointLoop, RolloutResult,
                       register_rollout)
from .server import Endpoint
from . import verifiers  # noqa: F401 - registers the built-in rollout function "verifiers"

__all__ = ["ENDPOINT_ENV", "ROLLOUT_FUNCTIONS", "Endpoint", "EndpointConfig", "EndpointLoop", "Node",
           "RolloutResult", "Session", "register_rollout"]
