"""The ROS-free layers' Python log records reach the node's ROS logger (``ros/log_bridge.py``): every severity
through the one handler, the traceback of an exception, the level the ROS logger is set to, and nothing once
detached. rcutils writes to the process's stderr, read here with ``capfd``."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from rclpy.logging import LoggingSeverity, get_logger, set_logger_level  # noqa: E402

from orin_vlm_node.ros.log_bridge import PACKAGE_LOGGER, PackageLogs, RosLogHandler  # noqa: E402


def _lines(capfd) -> list[str]:
    return capfd.readouterr().err.splitlines()


def test_each_severity_goes_out_at_its_ros_severity(capfd):
    logs = PackageLogs(get_logger("bridge_severities"))
    try:
        log = logging.getLogger(f"{PACKAGE_LOGGER}.engine")
        log.info("reconfigured: page_size=32")
        log.warning("KV storage in ordinary pages")
        log.error("request req-3 failed")
        log.critical("cannot continue")
        log.info("a second info line")  # the same handler line again, after other severities
    finally:
        logs.detach()
    lines = [line for line in _lines(capfd) if "[bridge_severities]" in line]
    assert [line.split("]")[0] + "]" for line in lines] == ["[INFO]", "[WARN]", "[ERROR]", "[FATAL]", "[INFO]"]
    assert lines[0].endswith("reconfigured: page_size=32") and lines[4].endswith("a second info line")


def test_an_exception_is_logged_with_its_traceback(capfd):
    logs = PackageLogs(get_logger("bridge_traceback"))
    try:
        try:
            raise RuntimeError("kernel launch failed")
        except RuntimeError:
            logging.getLogger(f"{PACKAGE_LOGGER}.ros").exception("request req-7 failed")
    finally:
        logs.detach()
    err = "\n".join(_lines(capfd))
    assert "[ERROR]" in err and "request req-7 failed" in err
    assert "Traceback (most recent call last)" in err and "RuntimeError: kernel launch failed" in err


def test_the_ros_logger_level_decides_and_detach_restores(capfd):
    package = logging.getLogger(PACKAGE_LOGGER)
    before = package.level
    set_logger_level("bridge_levels", LoggingSeverity.DEBUG)
    logs = PackageLogs(get_logger("bridge_levels"))
    assert package.level == logging.DEBUG
    try:
        logging.getLogger(f"{PACKAGE_LOGGER}.kvcache").debug("block 7 freed")
    finally:
        logs.detach()
    assert package.level == before and not any(isinstance(h, RosLogHandler) for h in package.handlers)
    logging.getLogger(f"{PACKAGE_LOGGER}.kvcache").warning("after detach")
    lines = [line for line in _lines(capfd) if "[bridge_levels]" in line]
    assert len(lines) == 1 and lines[0].startswith("[DEBUG]") and lines[0].endswith("block 7 freed")


def test_records_below_the_ros_level_are_not_formatted(capfd):
    """At the default INFO level a debug record stops at the package logger (no cost, no line)."""
    logs = PackageLogs(get_logger("bridge_default"))
    try:
        logging.getLogger(f"{PACKAGE_LOGGER}.engine").debug("step 12 done")
        logging.getLogger(f"{PACKAGE_LOGGER}.engine").info("ready")
    finally:
        logs.detach()
    lines = [line for line in _lines(capfd) if "[bridge_default]" in line]
    assert len(lines) == 1 and lines[0].startswith("[INFO]")
