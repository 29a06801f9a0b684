"""The ROS layer uses only rclpy API that ROS 2 Humble (rclpy 3.3) has.

Why: the tests run on the ROS 2 Kilted wheels from PyPI, but a Jetson on JetPack 6 runs Humble, whose
rclpy lacks some of Kilted's API (``Node.list_parameters`` came in rclpy 4: a node calling it fails at
startup on every Humble robot while every test here passes). Humble's rclpy cannot be installed from PyPI,
so its API is written down here as names (from rclpy 3.3's sources) and the product's sources are checked
against it. A new use outside these lists fails: check that Humble has it, then add it here.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_SOURCES = sorted([*ROOT.joinpath("orin_vlm_node").rglob("*.py"), *ROOT.joinpath("launch").glob("*.py")])

# Module-level names of rclpy 3.3 (Humble) that the product may import; every one exists in Humble.
HUMBLE_MODULE_NAMES: dict[str, set[str]] = {
    "rclpy": {"init", "ok", "shutdown", "try_shutdown", "logging", "create_node", "spin", "spin_once"},
    "rclpy.duration": {"Duration"},
    "rclpy.exceptions": {"InvalidTopicNameException", "ParameterNotDeclaredException"},
    "rclpy.executors": {"ExternalShutdownException", "SingleThreadedExecutor", "MultiThreadedExecutor"},
    "rclpy.impl.rcutils_logger": {"RcutilsLogger"},
    "rclpy.lifecycle": {"LifecycleNode", "LifecycleState", "TransitionCallbackReturn", "LifecyclePublisher"},
    "rclpy.logging": {"LoggingSeverity", "get_logger"},
    "rclpy.node": {"Node"},
    "rclpy.parameter": {"Parameter"},
    "rclpy.qos": {"DurabilityPolicy", "HistoryPolicy", "QoSProfile", "ReliabilityPolicy", "qos_profile_sensor_data"},
    "rclpy.signals": {"SignalHandlerOptions"},
    "rclpy.validate_topic_name": {"validate_topic_name"},
}

# The public methods and properties of rclpy 3.3's Node and LifecycleNode.
HUMBLE_NODE_API = set(
    """add_managed_entity add_on_set_parameters_callback add_waitable clients context count_publishers
    count_subscribers create_client create_guard_condition create_lifecycle_publisher create_publisher create_rate
    create_service create_subscription create_timer declare_parameter declare_parameters default_callback_group
    describe_parameter describe_parameters destroy_client destroy_guard_condition destroy_lifecycle_publisher
    destroy_node destroy_publisher destroy_rate destroy_service destroy_subscription destroy_timer executor
    get_client_names_and_types_by_node get_clock get_fully_qualified_name get_logger get_name get_namespace
    get_node_names get_node_names_and_namespaces get_node_names_and_namespaces_with_enclaves get_parameter
    get_parameter_or get_parameter_type get_parameter_types get_parameters get_parameters_by_prefix
    get_publisher_names_and_types_by_node get_publishers_info_by_topic get_service_names_and_types
    get_service_names_and_types_by_node get_subscriber_names_and_types_by_node get_subscriptions_info_by_topic
    get_topic_names_and_types guards handle has_parameter on_activate on_cleanup on_configure on_deactivate
    on_error on_shutdown publishers remove_on_set_parameters_callback remove_waitable resolve_service_name
    resolve_topic_name services set_descriptor set_parameters set_parameters_atomically subscriptions timers
    trigger_activate trigger_cleanup trigger_configure trigger_deactivate trigger_shutdown undeclare_parameter
    waitables""".split()
)


@functools.cache
def _trees() -> list[tuple[Path, ast.AST]]:
    """The product's sources, parsed once for both checks."""
    return [(path, ast.parse(path.read_text(), str(path))) for path in PRODUCT_SOURCES]


def rclpy_module_names() -> set[tuple[str, str]]:
    """(module, name) for each ``from rclpy... import name`` and each ``rclpy.<...>.name`` in the product."""
    used = set()
    for _path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rclpy":
                used.update((node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Attribute):
                chain, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    chain.insert(0, value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id == "rclpy":
                    used.add((".".join(["rclpy", *chain[:-1]]), chain[-1]))
    return used


def attribute_names() -> dict[str, set[str]]:
    """Every attribute name the product reads or calls (``x.name``), with the files that use it."""
    where: dict[str, set[str]] = {}
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                where.setdefault(node.attr, set()).add(str(path.relative_to(ROOT)))
    return where


def test_rclpy_modules_are_used_through_names_humble_has():
    used = rclpy_module_names()
    assert ("rclpy.node", "Node") in used  # the scan sees the product's imports
    missing = sorted(f"{module}.{name}" for module, name in used if name not in HUMBLE_MODULE_NAMES.get(module, set()))
    assert not missing, f"not known to exist in Humble's rclpy (3.3): {missing}"


def test_node_methods_used_exist_in_humble():
    """A name that the installed (Kilted) rclpy's Node or LifecycleNode has and the product uses must be one
    Humble's Node has too; private names are the product's own attributes, not rclpy's."""
    pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")
    from rclpy.lifecycle import LifecycleNode
    from rclpy.node import Node

    rclpy_api = {name for name in dir(Node) + dir(LifecycleNode) if not name.startswith("_")}
    used = attribute_names()
    assert {"create_subscription", "declare_parameter"} <= set(used)  # the scan sees the node's calls
    missing = {name: sorted(files) for name, files in used.items() if name in rclpy_api - HUMBLE_NODE_API}
    assert not missing, f"Node API that Humble's rclpy (3.3) lacks: {missing}"
