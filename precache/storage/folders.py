"""precache's local folders: its home (``PRECACHE_HOME``), folders it trusts only if they are
private to this user, and the working folder of a run that writes a remote cache."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from precache.storage.locations import ENDPOINT_VARIABLES, StorageError, UnsafeFolderError

__all__ = ["precache_home", "private_dir", "work_dir_for"]


def precache_home() -> Path:
    """Where precache keeps local state: ``$PRECACHE_HOME``, else ``$XDG_CACHE_HOME/precache``,
    else ``~/.cache/precache``; as an absolute path. A relative ``$XDG_CACHE_HOME`` is ignored,
    as the XDG specification says. What precache trusts there (the disk cache) is checked to be
    private when it is used: see ``private_dir``."""
    if os.environ.get("PRECACHE_HOME"):
        return Path(os.environ["PRECACHE_HOME"]).absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "precache"


def private_dir(path: str | os.PathLike[str], what: str = "folder", instead: str = "") -> Path:
    """The local folder ``path``, made (mode 0700) if missing, and checked to be writable by this
    user alone, since precache trusts what it finds there; returns its real path (symbolic links
    resolved), which callers then use, so a link swapped later cannot redirect them.

    Checked: the folder belongs to this user and is not group- or world-writable (one only
    readable by others is made 0700); every folder above it belongs to this user or root and is
    not world-writable unless sticky (like ``/tmp``), so nobody else can rename it away and put
    their own in its place. A group-writable folder above is accepted: systems with a private
    group per user make home folders group-writable.

    Args:
        what: what the folder is, for messages (``"disk cache folder"``).
        instead: how to name another folder, for messages (default: ``$PRECACHE_HOME``).

    Raises:
        UnsafeFolderError: another user could write there; names the folder and the fix.
        StorageError: the folder cannot be made.
    """
    path = Path(path).absolute()
    instead = instead or "use a folder of your own instead: PRECACHE_HOME=/a/folder/on/local/disk"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a file: reported below
    except OSError as e:
        raise StorageError(f"cannot make {what} '{path}' ({e.strerror}); {instead}") from None
    real = Path(os.path.realpath(path))
    uid = os.geteuid()
    info = os.stat(real)
    named = f"{what} '{path}'" + (f" (really '{real}')" if real != path else "")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolderError(f"{named} is not a folder; {instead}")
    if info.st_uid != uid:
        raise UnsafeFolderError(
            f"{named} belongs to user {info.st_uid}, not to you (user {uid}): its owner could "
            f"put files there that precache would take for its own; {instead}")
    if info.st_mode & 0o022:
        raise UnsafeFolderError(
            f"{named} is writable by other users (mode {stat.S_IMODE(info.st_mode):04o}), who "
            "could have put files there that precache would take for its own; delete it "
            f"(precache then makes a private one), or {instead}")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(real, 0o700)  # ours, and only we could write to it: keep it so, and unread
    for parent in real.parents:
        info = os.stat(parent)
        if info.st_uid not in (uid, 0):
            raise UnsafeFolderError(
                f"'{parent}', a folder above {named}, belongs to user {info.st_uid}, who could "
                f"replace the folder with one of their own; {instead}")
        if info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX:
            raise UnsafeFolderError(
                f"'{parent}', a folder above {named}, is writable by every user and not sticky "
                f"(mode {stat.S_IMODE(info.st_mode):04o}), so anyone could replace the folder "
                f"with one of their own; {instead}")
    return real


def work_dir_for(url: str) -> Path:
    """The local working directory of a run writing the remote cache ``url`` (its lock, journal
    and staging): ``precache_home()/work/<hash of the URL and endpoint>``."""
    endpoint = next((os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)), "")
    key = hashlib.sha256(f"{url.rstrip('/')}\n{endpoint}".encode()).hexdigest()[:16]
    return precache_home() / "work" / key
