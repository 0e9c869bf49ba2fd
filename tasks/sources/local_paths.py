"""What a folder's storage (`LocalStorage`) may list and read: the files under its root, nothing a
key or a link (unless followed) leads to outside it (docs/sources.md, "A local folder")."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator

from vlm_caption.tasks.sources.items import BadInput, ObjectRef, RefusedRef

LINK_OUTSIDE = ("a link to outside the source folder: not followed (the job's follow_links, "
                "--follow-links, allows it)")


class RefusedKey(BadInput):
    """A key a folder's storage does not read or write: it leads outside the root."""


def within(path: str, root: str) -> bool:
    """Whether `path` (resolved) is `root` or below it."""
    return path == root or path.startswith(os.path.join(root, ""))


def key_path(root: str, key: str, follow_links: bool = True) -> str:
    """The path `key` names below `root` (a resolved folder), checked at each read, not only at the
    listing (a link changed between this check and the open is not: no lock can stop it)."""
    if os.path.isabs(key) or ".." in key.replace(os.sep, "/").split("/"):
        raise RefusedKey(f"{key}: a key that leads outside the folder (absolute, or with a `..` part)")
    path = os.path.join(root, key)
    if not follow_links and not within(os.path.realpath(path), root):
        raise RefusedKey(f"{key}: {LINK_OUTSIDE}")
    return path


def _all_before(folder: str, key: str) -> bool:  # every key under `folder` sorts before `key`
    return bool(key) and folder < key and not key.startswith(folder)


def walk_files(root: str, start: str, prefix: str, start_after: str, wanted: Callable[[str], bool],
               follow_links: bool) -> Iterator[ObjectRef]:
    """Every file below `start` whose key begins with `prefix`, sorts after `start_after` and is
    `wanted`, in a sorted walk; names beginning with a dot are left out."""
    if not follow_links and not within(os.path.realpath(start), root):
        return  # a prefix through a link that leads out: nothing under it is the source's
    skip = len(os.path.join(root, ""))
    walked: set[str] = set()  # folders outside the root entered through a link: a link back to one would loop
    for dirpath, dirnames, filenames in os.walk(start, followlinks=follow_links):
        folder = os.path.join(dirpath, "")  # strings: Path joins and relative_to were most of a big listing
        below = folder[skip:].replace(os.sep, "/")
        names, folders = [n for n in filenames if not n.startswith(".")], []
        # A folder whose every key sorts before `start_after` is not walked (one page after a key).
        for name in sorted(d for d in dirnames if not d.startswith(".")
                           and not _all_before(below + d + "/", start_after)):
            if os.path.islink(folder + name):
                real = os.path.realpath(folder + name)
                if within(real, root) or real in walked:
                    continue
                if not follow_links:
                    names.append(name)  # listed as what it is: one refused link
                    continue
                walked.add(real)
            folders.append(name)
        dirnames[:] = folders
        for name in sorted(names):
            relative = (folder + name)[skip:].replace(os.sep, "/")
            if relative.startswith(prefix) and relative > start_after and wanted(relative):
                yield _listed(root, relative, folder + name, follow_links)  # judged on the name: no stat before


def _listed(root: str, relative: str, path: str, follow_links: bool) -> ObjectRef:
    """The file's ref: its own size and time, or its target's where it is a link that may be followed."""
    found = os.lstat(path)
    if stat.S_ISLNK(found.st_mode):
        own = (relative, found.st_size, f"link-{found.st_size:x}-{found.st_mtime_ns:x}", found.st_mtime)
        if not follow_links and not within(os.path.realpath(path), root):
            return RefusedRef(*own, problem=f"{relative}: {LINK_OUTSIDE}")
        try:
            found = os.stat(path)
        except OSError as exc:  # a dangling link, or a loop of links
            return RefusedRef(*own, problem=f"{relative}: a link that leads to no file ({exc.strerror})")
    return ObjectRef(relative, found.st_size, f"{found.st_size:x}-{found.st_mtime_ns:x}", found.st_mtime)
