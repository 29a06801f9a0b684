"""The package's Python ``logging`` records, into the node's ROS logger.

Why: the ROS-free layers (engine, KV cache, model loading, kernel build, the worker) log with Python's
``logging``, which a ROS process does not configure. Without this, their warnings reached stderr as bare text
through ``logging.lastResort`` (not in ``/rosout``, ``rqt_console`` or the launch log files), and their
INFO lines (a reconfiguration applied, a kernel cache rebuilt) were lost. While the node lives, every record
of the ``orin_vlm_node`` loggers goes to the node's logger at the matching severity, and the Python level
follows the ROS logger's (``--ros-args --log-level warn`` quiets the layers' INFO lines as well).
"""

from __future__ import annotations

import logging

from rclpy.impl.rcutils_logger import RcutilsLogger
from rclpy.logging import LoggingSeverity, get_logger

PACKAGE_LOGGER = "orin_vlm_node"

# Python levels and ROS severities share their numbers (DEBUG 10 ... FATAL 50); a record goes out at the
# highest severity not above its level.
_SEVERITIES = sorted(
    (LoggingSeverity.DEBUG, LoggingSeverity.INFO, LoggingSeverity.WARN, LoggingSeverity.ERROR, LoggingSeverity.FATAL),
    reverse=True,
)


class RosLogHandler(logging.Handler):
    """Formats a record (its traceback included) and logs it under ``ros_logger``'s name.

    One rclpy logger object per severity: rclpy keys each call site's context by the calling line and
    refuses a second severity from the same line, and every record comes through the same line here.
    """

    def __init__(self, ros_logger: RcutilsLogger) -> None:
        super().__init__()
        self._by_severity = {severity: get_logger(ros_logger.name) for severity in _SEVERITIES}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            severity = next((s for s in _SEVERITIES if record.levelno >= s), LoggingSeverity.DEBUG)
            self._by_severity[severity].log(message, severity)
        except Exception:
            self.handleError(record)


class PackageLogs:
    """Routes the package's records to a node's logger from construction until :meth:`detach`, which puts
    the package logger's level back."""

    def __init__(self, ros_logger: RcutilsLogger) -> None:
        self._logger = logging.getLogger(PACKAGE_LOGGER)
        self._previous_level = self._logger.level
        self._handler = RosLogHandler(ros_logger)
        self._logger.setLevel(int(ros_logger.get_effective_level()))
        self._logger.addHandler(self._handler)

    def detach(self) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._previous_level)
