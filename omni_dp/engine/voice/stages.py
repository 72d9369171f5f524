"""A voice's stages in a stage process of its own (engine/stage_process.py hands over here when
the launch names the voice pipeline).

preprocess: each Prepare on one of two worker threads (espeak-ng is a process per sentence:
they wait on it, not on the cores), answered with Prepared. voice: each Speak on one of the
process's `threads` workers, one onnxruntime call per sentence, answered with Spoken. Workers
send their own answers (the Outbox gives each thread its own socket). A failed ONNX call fails
the process, as it fails a replica that speaks in its front: the front restarts nothing by
itself, the launcher restarts the replica.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from omni_dp.engine import messages
from omni_dp.engine.links import Inbox
from omni_dp.engine.preprocess import PreprocessError
from omni_dp.engine.stage_launch import StageLaunch
from omni_dp.engine.voice.messages import Speak, Spoken
from omni_dp.engine.voice.model import VoiceSession, find_voice, pcm16
from omni_dp.engine.voice.phonemes import PhonemizeError
from omni_dp.engine.voice.preprocess import PHONEMIZER_THREADS, VoicePreprocess
from omni_dp.tracing import stage_work

if TYPE_CHECKING:
    from omni_dp.engine.links import Outbox

log = logging.getLogger("omni_dp.stage")


class VoiceStages:
    """What this process serves: the preprocess stage, the voice stage, or both."""

    def __init__(self, spec: StageLaunch, outbox: Outbox, fatal: Callable[[str], None]) -> None:
        voice = find_voice(spec.model)
        self.spec = spec
        self.outbox = outbox
        self.fatal = fatal
        self.preprocess = (VoicePreprocess(voice, spec.max_input_chars,
                                           spec.voice_first_piece_chars)
                           if "preprocess" in spec.stages else None)
        self.session = VoiceSession(voice, spec.device) if "voice" in spec.stages else None
        self.phonemizers = ThreadPoolExecutor(PHONEMIZER_THREADS, thread_name_prefix="phonemes")
        self.speakers = ThreadPoolExecutor(max(1, spec.threads), thread_name_prefix="voice")

    def take(self, message: object) -> bool:
        """Queue a request for its stage's workers; False when no stage here takes it."""
        if isinstance(message, messages.Prepare) and self.preprocess is not None:
            self.phonemizers.submit(self._prepare, message)
        elif isinstance(message, Speak) and self.session is not None:
            self.speakers.submit(self._speak, message)
        else:
            return False
        return True

    def _prepare(self, message: messages.Prepare) -> None:
        assert self.preprocess is not None
        try:
            with stage_work("preprocess", self.spec.process, message.traceparent):
                speech = self.preprocess.prepare(message.ask)
            answer = messages.Prepared(message.request_id, speech)
        except PreprocessError as exc:
            answer = messages.Prepared(message.request_id, None, exc.field, str(exc))
        except PhonemizeError as exc:  # this request's (a 503); the process stays up
            log.error("the phonemizer failed: %s", exc)
            answer = messages.Prepared(message.request_id, None, None,
                                       f"the phonemizer failed: {exc}")
        except Exception:  # anything else is a stage we cannot trust
            self.fatal(f"stage process {self.spec.process}: preprocess failed:\n"
                       f"{traceback.format_exc()}")
            return
        self.outbox.send(self.spec.front, answer)

    def _speak(self, message: Speak) -> None:
        assert self.session is not None
        try:
            with stage_work("voice", self.spec.process, message.traceparent) as span:
                samples = self.session.run(message.ids, length_scale=message.length_scale,
                                           speaker=message.speaker_id)
                if span is not None:
                    span.set_attribute("omni_dp.phoneme_ids", len(message.ids))
        except Exception as exc:  # onnxruntime's errors: the replica must be restarted
            self.fatal(f"stage process {self.spec.process}: the voice stage failed: {exc}")
            return
        self.outbox.send(self.spec.front, Spoken(message.sentence_id, pcm16(samples)))

    def stop(self) -> None:
        self.phonemizers.shutdown(wait=False, cancel_futures=True)
        self.speakers.shutdown(wait=False, cancel_futures=True)


def serve_voice_stages(spec: StageLaunch, outbox: Outbox, fatal: Callable[[str], None]) -> int:
    """Build this process's voice stages, say Ready, serve until the front says Stop."""
    try:
        stages = VoiceStages(spec, outbox, fatal)
    except Exception as exc:  # the voice or its session cannot be had: the front reports it
        fatal(f"stage process {spec.process}: start-up failed: {exc}")
        return 3
    inbox = Inbox(spec.inbox)
    outbox.send(spec.front, messages.Ready(spec.process, os.getpid()))
    log.info("stage process %s (pid %d): %s's %s on %s", spec.process, os.getpid(),
             spec.model, " and ".join(spec.stages), spec.device)
    try:
        while not isinstance(message := inbox.recv(None), messages.Stop):
            if not stages.take(message):
                log.warning("stage process %s: no stage here takes %s", spec.process,
                            type(message).__name__)
    except Exception:  # a message it cannot read: the replica cannot be trusted
        fatal(f"stage process {spec.process}: serving failed:\n{traceback.format_exc()}")
    stages.stop()
    inbox.close()
    outbox.close_all()
    return 0
