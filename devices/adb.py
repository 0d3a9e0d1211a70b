"""A connected Android device, through the `adb` executable (Debian package `adb`).

Every failure a user can meet becomes one clear UserError: no adb, no such device, an
unauthorized or offline device, and a device that disappears in the middle of a command
(`DeviceLost`, so that the caller can keep what was measured before it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from mtp_edge.errors import UserError

# adb's words for a device that went away while we talked to it
LOST = ("not found", "offline", "no devices", "device unauthorized", "closed", "disconnected")


class DeviceLost(UserError):
    """The device stopped answering in the middle of the run."""


@dataclass
class DeviceInfo:
    serial: str
    model: str
    soc: str
    abi: str
    free_bytes: int  # in the working directory
    battery_percent: int | None
    battery_celsius: float | None
    thermal_status: int | None  # Android's PowerManager thermal status: 0 none .. 6 shutdown

    def describe(self) -> str:
        battery = "?" if self.battery_percent is None else f"{self.battery_percent}%"
        heat = "?" if self.battery_celsius is None else f"{self.battery_celsius:.1f} C"
        thermal = "?" if self.thermal_status is None else str(self.thermal_status)
        return (
            f"{self.model} ({self.soc}, {self.abi}), {self.free_bytes / 2**20:.0f} MB free, "
            f"battery {battery} at {heat}, thermal status {thermal}"
        )


class Adb:
    def __init__(self, serial: str):
        exe = os.environ.get("ADB") or shutil.which("adb")
        if exe is None:
            raise UserError(
                "adb is not installed: install it (Debian/Ubuntu: apt-get install adb) "
                "or put it on PATH"
            )
        self.exe, self.serial = exe, serial

    def check_attached(self) -> None:
        """The serial is listed by `adb devices` in the `device` state."""
        out = self._call(["devices"], timeout=30).stdout
        states = {}
        for line in out.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 2:
                states[parts[0]] = parts[1]
        state = states.get(self.serial)
        if state is None:
            listed = ", ".join(f"{s} ({st})" for s, st in states.items()) or "none"
            raise UserError(
                f"no device {self.serial} attached (adb devices lists: {listed}): connect it "
                "with USB debugging on, or pass one of the listed serials"
            )
        if state == "unauthorized":
            raise UserError(
                f"device {self.serial} is unauthorized: unlock it and accept the 'Allow USB "
                "debugging' prompt, then retry"
            )
        if state != "device":
            raise UserError(
                f"device {self.serial} is {state}: reconnect the cable (or run adb reconnect)"
            )

    def run(self, *args: str, timeout: float = 120) -> str:
        """`adb -s SERIAL args...`; its stdout. A vanished device raises DeviceLost."""
        result = self._call(["-s", self.serial, *args], timeout=timeout)
        text = (result.stderr + result.stdout).strip()
        if result.returncode != 0 or result.stderr.strip().startswith("error:"):
            if any(word in text.lower() for word in LOST):
                raise DeviceLost(f"device {self.serial} was lost during `adb {args[0]}`: {text}")
            last = text.splitlines()[-1] if text else f"exit code {result.returncode}"
            raise UserError(f"adb {' '.join(args[:2])} failed on {self.serial}: {last}")
        return result.stdout

    def shell(self, command: str, timeout: float = 120) -> str:
        return self.run("shell", command, timeout=timeout)

    def _call(self, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(
                [self.exe, *args], capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise DeviceLost(
                f"adb {' '.join(args)} did not answer within {timeout:.0f} s: is the device "
                "still connected?"
            ) from None
        except OSError as e:
            raise UserError(f"cannot run adb ({self.exe}): {e.strerror}") from None

    def info(self, workdir: str) -> DeviceInfo:
        def prop(name: str) -> str:
            return self.shell(f"getprop {name}").strip()

        soc = prop("ro.soc.model") or prop("ro.board.platform") or prop("ro.hardware")
        return DeviceInfo(
            serial=self.serial,
            model=prop("ro.product.model") or "unknown model",
            soc=soc or "unknown SoC",
            abi=prop("ro.product.cpu.abi") or "unknown",
            free_bytes=parse_free_bytes(self.shell(f"mkdir -p {workdir} && df -k {workdir}")),
            **parse_battery(self.shell("dumpsys battery")),
            thermal_status=parse_thermal(self.shell("dumpsys thermalservice")),
        )


def parse_free_bytes(df: str) -> int:
    """Available bytes from `df -k DIR` (toybox: Filesystem 1K-blocks Used Available ...)."""
    lines = [line.split() for line in df.strip().splitlines() if line.strip()]
    if len(lines) < 2:
        raise UserError(f"cannot read free storage from the device's df output: {df!r}")
    header, row = lines[0], lines[-1]
    column = header.index("Available") if "Available" in header else 3
    try:
        return int(row[column]) * 1024
    except (ValueError, IndexError):
        raise UserError(f"cannot read free storage from the device's df output: {df!r}") from None


def parse_battery(dumpsys: str) -> dict:
    values = {}
    for line in dumpsys.splitlines():
        key, _, value = line.strip().partition(":")
        values[key.strip()] = value.strip()
    level = values.get("level")
    temperature = values.get("temperature")  # tenths of a degree Celsius
    return {
        "battery_percent": int(level) if level and level.isdigit() else None,
        "battery_celsius": int(temperature) / 10 if temperature and temperature.isdigit() else None,
    }


def parse_thermal(dumpsys: str) -> int | None:
    for line in dumpsys.splitlines():
        if line.strip().startswith("Thermal Status:"):
            value = line.split(":", 1)[1].strip()
            return int(value) if value.isdigit() else None
    return None
