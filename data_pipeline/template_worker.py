"""A chat template rendered in a separate process, with a time, memory and output-size limit.

Jinja's sandbox stops a template from running code, but not from looping (nested ``range(100000)``)
or from allocating (``'x' * 3000000000``, ``'x'.center(10**10)``, a list grown in a loop). No
in-process guard covers every construct, so the template runs in a child process started with
``spawn`` (it imports only transformers' renderer, never torch): its address space is capped with
``RLIMIT_AS`` (an allocation past it is a MemoryError in the child), a render that does not answer
within the time limit has its child killed (and a new one started for the next render), and a text
longer than the output limit is never sent back. An error says which limit was reached and never
carries the rendered text (a template's own error message is cut to a few hundred characters).

`TemplateWorker.render` is what `data_pipeline.chat_template.render_chat_template` calls; one worker
serves one render at a time (a lock), and each process has a default worker started on first use.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import threading

__all__ = ["TemplateWorker", "RenderLimit", "RenderFailure", "default_worker"]

MESSAGE_CHARS = 300  # the most of a template's own error message an error repeats


class RenderLimit(Exception):
    """A render passed a limit: `what` is "time", "memory" or "size"."""

    def __init__(self, what: str, detail: str):
        super().__init__(detail)
        self.what = what


class RenderFailure(Exception):
    """The template itself failed (a Jinja error, a TypeError of its code, `raise_exception`)."""


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * _page_size()


def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + " ..."


def _serve(conn, memory_bytes: int) -> None:  # the child's main loop
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it ends this child)

    from transformers.utils.chat_template_utils import render_jinja_template

    try:  # the address space the child has after its imports, plus the allowance
        limit = _vm_bytes() + memory_bytes
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    except (OSError, ValueError):  # pragma: no cover - a system without /proc or RLIMIT_AS: time and size limits only
        pass
    templates: dict[str, str] = {}
    conn.send(("ready",))
    while True:
        try:
            key, template, messages, kwargs, max_chars = conn.recv()
        except (EOFError, OSError):
            return
        except MemoryError:  # the request itself is too large: the rest of it may still be in the pipe
            conn.send(("memory", None))
            return
        if template is not None:
            templates[key] = template
        try:
            spans = kwargs.pop("_spans")
            texts, indices = render_jinja_template([messages], chat_template=templates[key],
                                                   return_assistant_tokens_mask=spans, **kwargs)
            text = texts[0]
            if len(text) > max_chars:
                reply = ("size", len(text))
            else:
                reply = ("ok", text, [tuple(s) for s in indices[0]] if spans else [])
            del texts, text
        except MemoryError:
            reply = ("memory", None)
        except RecursionError:
            reply = ("error", "RecursionError: the template recurses too deep")
        except Exception as e:  # noqa: BLE001 - whatever a template raises (jinja2.TemplateError, TypeError, ...)
            reply = ("error", f"{type(e).__name__}: {_short(e)}")
        try:
            conn.send(reply)
        except MemoryError:
            conn.send(("memory", None))


class TemplateWorker:
    """One child process rendering templates under `memory_bytes` of extra address space."""

    def __init__(self, memory_bytes: int = 1 << 30, start_timeout_s: float = 300.0):
        self.memory_bytes, self.start_timeout_s = int(memory_bytes), float(start_timeout_s)
        self._proc = self._conn = None
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked copy of this object starts its own child, never shares the pipe

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads and torch
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.memory_bytes), daemon=True,
                           name="setdlm-chat-template")
        proc.start()
        child.close()
        self._proc, self._conn, self._seen = proc, parent, set()
        try:  # its imports are not the template's time
            ready = parent.poll(self.start_timeout_s) and parent.recv() == ("ready",)
        except (EOFError, OSError):
            ready = False
        if not ready:
            code = proc.exitcode
            self.close()
            raise RenderLimit("crash", f"the rendering process did not start (exit code {code})")

    def close(self) -> None:
        """Stops the child (the next render starts another)."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None:
            proc.kill()
            proc.join(5)

    def render(self, template: str, messages: list, kwargs: dict, spans: bool, *, time_limit_s: float,
               max_chars: int) -> tuple[str, list]:
        """(text, generation spans) of `messages`; RenderLimit or RenderFailure. The time counts from
        the request being sent (a child's start-up is not counted)."""
        with self._lock:
            if self._pid != os.getpid():  # inherited through fork: the child and the pipe are the parent's
                self._proc = self._conn = None
                self._pid = os.getpid()
            if self._proc is None or not self._proc.is_alive():
                self.close()
                self._start()
            key = hashlib.sha256(template.encode("utf-8", "surrogatepass")).hexdigest()
            try:
                self._conn.send((key, None if key in self._seen else template, messages,
                                 {**kwargs, "_spans": spans}, int(max_chars)))
            except (BrokenPipeError, EOFError, OSError):
                self.close()
                raise RenderLimit("crash", "the rendering process ended") from None
            self._seen.add(key)
            if not self._conn.poll(time_limit_s):
                self.close()  # killed mid-render: the only way to stop a loop that holds the interpreter
                raise RenderLimit("time", f"rendering took longer than the limit of {time_limit_s:g} s")
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                code = self._proc.exitcode if self._proc is not None else None
                self.close()
                raise RenderLimit("crash", f"the rendering process ended (exit code {code})") from None
        if reply[0] == "ok":
            return reply[1], list(reply[2])
        if reply[0] == "size":
            raise RenderLimit("size", f"the rendering is {reply[1]} characters, over the limit of {max_chars}")
        if reply[0] == "memory":
            raise RenderLimit("memory", f"rendering needs more than the limit of {self.memory_bytes >> 20} MiB "
                                        f"of memory")
        raise RenderFailure(reply[1])


_DEFAULT: TemplateWorker | None = None
_DEFAULT_LOCK = threading.Lock()


def default_worker() -> TemplateWorker:
    """This process's shared worker (started on its first render)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = TemplateWorker()
        return _DEFAULT
