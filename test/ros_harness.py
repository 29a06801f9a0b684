"""Shared helpers of the node tests: a domain id per module and one node+client per module.

The node runs as a separate process (``support.node_process.NodeProcess``) and the test talks
to it over real DDS with ``support.node_client.VlmClient``, both with localhost-only discovery
and a ROS_DOMAIN_ID derived from this process id and the module name, so concurrent runs on one
machine do not hear each other.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from support.node_client import VlmClient
from support.node_process import NodeProcess, domain_id_for

# Small answers keep the node tests fast; greedy so answers can be compared.
FAST_PARAMS: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0.0, "image_max_age_s": 30.0}


@contextmanager
def running_node(
    params: Mapping[str, Any], workdir: Path, salt: str, ready_timeout: float = 120.0
) -> Iterator[tuple[NodeProcess, VlmClient]]:
    """Start the node with ``params``, connect a client (to the first channel, when there are channels),
    yield both once the client has the node's ``ready`` event; always stop and clean up.

    Why wait for ``ready``: the client seeing the node's publishers does not mean the node's status publisher
    has matched the client's subscription yet (discovery runs on both sides, seconds apart on a loaded
    machine), and status is volatile, so an event published in between (a first prompt's ``accepted``) never
    reaches the client. The node announces ``ready`` once its status publisher has a subscriber."""
    domain = domain_id_for(salt)
    # One torch thread: the test machines are small and shared, and the in-process reference engine
    # uses one thread too (same reduction order, same greedy tokens).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    node = NodeProcess(params, workdir, domain, env=env)
    client = None
    try:
        channel = (params.get("channels") or [""])[0]
        topics = params.get(f"{channel}.image_topics") or params.get("image_topics") or ["image"]
        client = VlmClient(domain, image_topic=topics[0], channel=channel)
        client.wait_until_connected(node, timeout=ready_timeout)
        client.wait_for(lambda: client.events(event="ready"), ready_timeout, "the ready event")
        yield node, client
    finally:
        if client is not None:
            client.close()
        node.stop()
