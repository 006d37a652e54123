"""The first process of the grader's child namespaces (run by path, as their root): seal, then start.

    unshare --pid --fork --mount --net ... python -I -S jail.py SCRATCH -- COMMAND...

It brings the loopback interface up (ranks talk over 127.0.0.1; nothing else is reachable),
keeps SCRATCH writable (a bind mount of its own), gives ``/dev/shm`` a fresh empty tmpfs, makes
every other mount read-only, then starts COMMAND (which drops the privileges: ``setpriv``) and
reaps orphans until COMMAND ends. When this process exits the kernel kills every process left in
the namespace: nothing the student's code started outlives it. It imports nothing of labkit.
"""
import fcntl
import os
import socket
import struct
import subprocess
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
KEPT_OPTIONS = {"nosuid", "nodev", "noexec", "noatime", "nodiratime", "relatime", "strictatime"}


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def mounts() -> list[tuple[str, list[str]]]:
    """(mount point, its options) of every mount, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape") if "\\" in fields[4] else fields[4]
            out.append((point, fields[5].split(",")))
    return out


def seal(scratch: str) -> None:
    before = mounts()
    course = max((p for p, _ in before if os.path.dirname(scratch).startswith(p.rstrip("/") + "/")),
                 key=len, default="/")  # the mount holding the course's copy: it must seal
    subprocess.run(["mount", "--bind", scratch, scratch], check=True)
    if os.path.isdir("/dev/shm"):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm"], check=True)
    for point, options in before:
        if "ro" in options or point in ("/proc", "/dev/shm") or point.startswith("/proc/"):
            continue
        kept = [o for o in options if o in KEPT_OPTIONS]  # a user namespace may not clear them
        done = subprocess.run(["mount", "-o", ",".join(["remount", "bind", "ro", *kept]), point],
                              capture_output=True)
        if done.returncode and point == course:
            sys.exit(f"jail: cannot make {point} read-only: {done.stderr.decode().strip()}")


def main(argv: list[str]) -> int:
    scratch, command = argv[0], argv[argv.index("--") + 1:]
    loopback_up()
    seal(scratch)
    child = os.fork()
    if child == 0:
        os.execvp(command[0], command)
    while True:  # reap every orphan; end with the command
        pid, status = os.wait()
        if pid == child:
            return os.waitstatus_to_exitcode(status) if status else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
