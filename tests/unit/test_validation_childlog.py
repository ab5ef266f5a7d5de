"""summarize_child_failure: a failed child's pages of output become the one line that says what went wrong."""

from __future__ import annotations

from qualify.childlog import MAX_SUMMARY, child_failure_message, summarize_child_failure

VLLM_TP3 = """\
INFO 11-30 18:00:01 [__init__.py:241] Automatically detected platform cpu.
WARNING 11-30 18:00:02 [_custom_ops.py:20] Failed to import from vllm._C with ImportError('libcuda.so.1')
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/work/main/qualify/rollout/vllm_worker.py", line 70, in <module>
    main()
  File "/venv/lib/python3.11/site-packages/vllm/config/parallel.py", line 512, in _verify_args
    raise ValueError(
ValueError: Total number of attention heads (4) must be divisible by tensor parallel size (3).
[rank0]:[W1130 18:00:03.123456 ProcessGroupGloo.cpp:123] Warning: destroying the process group
"""

ENGINE_CORE = """\
(EngineCore_DP0 pid=4242) ERROR 11-30 18:00:05 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=4242) ERROR 11-30 18:00:05 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=4242) ERROR 11-30 18:00:05 [core.py:708]   File "/venv/vllm/v1/engine/core.py", line 699, in run
(EngineCore_DP0 pid=4242) ERROR 11-30 18:00:05 [core.py:708] torch.OutOfMemoryError: CUDA out of memory. Tried to \
allocate 2.00 GiB
Traceback (most recent call last):
  File "/work/main/qualify/rollout/vllm_worker.py", line 70, in <module>
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_exception_line_of_a_traceback():
    assert summarize_child_failure(VLLM_TP3) == ("ValueError: Total number of attention heads (4) must be divisible "
                                                 "by tensor parallel size (3).")


def test_the_root_cause_beats_a_wrapper_that_points_to_it():
    assert summarize_child_failure(ENGINE_CORE) == ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                                    "2.00 GiB")


def test_a_generic_wrapper_alone_is_still_reported():
    text = "Traceback (most recent call last):\nRuntimeError: Engine core initialization failed. See root cause above."
    assert summarize_child_failure(text).startswith("RuntimeError: Engine core initialization failed")


def test_chained_exceptions_give_the_last_one():
    text = ("Traceback (most recent call last):\nKeyError: 'x'\n\nThe above exception was the direct cause of the "
            "following exception:\n\nTraceback (most recent call last):\nqualify.errors.EvidenceError: bad rollout\n")
    assert summarize_child_failure(text) == "qualify.errors.EvidenceError: bad rollout"


def test_an_error_log_line_without_a_traceback():
    text = ("INFO 11-30 18:00:01 [a.py:1] starting\nERROR 11-30 18:00:02 [b.py:2] worker died: signal 9\n"
            "INFO 11-30 18:00:03 [a.py:1] shutting down\n")
    assert summarize_child_failure(text) == "worker died: signal 9"


def test_plain_output_gives_its_last_meaningful_line():
    text = "loading model\ncould not open /models/x/config.json\nWARNING 11-30 18:00:02 [w.py:3] bye\n\n"
    assert summarize_child_failure(text) == "could not open /models/x/config.json"


def test_colour_codes_and_blank_output():
    assert summarize_child_failure("\x1b[31mValueError: red\x1b[0m\n") == "ValueError: red"
    assert summarize_child_failure("") == "(no output)"
    assert summarize_child_failure("\n  \n") == "(no output)"
    assert summarize_child_failure("WARNING 11-30 18:00:02 [w.py:3] only noise\n") == "only noise"


def test_the_summary_is_one_bounded_line():
    summary = summarize_child_failure("ValueError: " + "x" * 5000 + "\tand\ttabs")
    assert len(summary) == MAX_SUMMARY and summary.endswith("...") and "\n" not in summary


def test_the_message_names_the_log_file():
    message = child_failure_message("vLLM capture at TP3", 1, VLLM_TP3, "runs/x/reference/rollout/tp3.log")
    assert message == ("vLLM capture at TP3 failed (exit 1): ValueError: Total number of attention heads (4) must be "
                       "divisible by tensor parallel size (3). (full output: runs/x/reference/rollout/tp3.log)")
    assert "\n" not in message


HOSTILE = "boom\x1b[2J\x1b]0;pwned\x07 \r\x08\x7f\x9b\u202etxt.exe\u2066 end\nnext\tcol"


def test_printable_escapes_every_control_character_of_a_foreign_string():
    """ESC, BEL, CR, backspace, DEL, C1 and bidirectional overrides from an engine's message become visible escapes;
    a tab stays; a newline is escaped too unless the caller keeps its own lines."""
    from qualify.childlog import printable

    assert printable(HOSTILE) == ("boom\\x1b[2J\\x1b]0;pwned\\x07 \\x0d\\x08\\x7f\\x9b\\u202etxt.exe\\u2066 end\\x0anext"
                                  "\tcol")
    assert printable(HOSTILE, newlines=True).split("\n") == [printable("boom\x1b[2J\x1b]0;pwned\x07 \r\x08\x7f\x9b"
                                                                       "\u202etxt.exe\u2066 end"), "next\tcol"]
    assert printable("plain ascii, [rich] markup and unicode: µ é") == "plain ascii, [rich] markup and unicode: µ é"


def test_a_rank_exception_and_a_launch_log_are_quoted_escaped(tmp_path):
    """failure_note, the 'did not run' note of a case: an engine's exception message and its log's last lines."""
    import json
    import time

    from qualify.case.launch import failure_note

    log_path = tmp_path / "launch.log"
    log_path.write_text(f"line one\n{HOSTILE}\n")
    note = failure_note(tmp_path, log_path, 1)  # no recorded exception: the log's tail
    assert not any(c in note for c in "\x1b\x07\r\x08\x7f\x9b\u202e") and "\\x1b[2J" in note
    assert note.splitlines()[1:] == ["line one", "boom\\x1b[2J\\x1b]0;pwned\\x07 ",  # a log's CR ends its line
                                     "\\x08\\x7f\\x9b\\u202etxt.exe\\u2066 end", "next\tcol"]
    (tmp_path / "failure-rank0.json").write_text(json.dumps({"rank": 0, "type": "Runtime\x1bError",
                                                             "message": HOSTILE, "time": time.time()}))
    note = failure_note(tmp_path, log_path, 1)
    assert note.startswith("Runtime\\x1bError: boom\\x1b[2J") and "\n" not in note and "\x1b" not in note
