"""`pagoda bench serve` with bad flags, or against a server that is not there: one line naming the flag (argparse's,
exit 2) instead of a traceback or a run that sends a level nobody asked for; a level whose requests failed says
why."""

from __future__ import annotations

import socket

import pytest

from pagoda.cli import build_parser, main


@pytest.mark.parametrize(("flag", "value"), [
    ("--concurrency", "abc"), ("--concurrency", "-1"), ("--concurrency", "0"), ("--concurrency", "4,x"),
    ("--request-rate", "0"), ("--request-rate", "-2"), ("--request-rate", "nan"), ("--request-rate", "inf"),
    ("--num-prompts", "0"), ("--num-prompts", "-5"), ("--input-len", "0"), ("--output-len", "-1"),
    ("--rounds", "0"), ("--vocab-size", "0")])
def test_a_bad_load_or_size_flag_is_refused_naming_it(flag: str, value: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """--concurrency abc / -1 and --vocab-size 0 were tracebacks (int(), asyncio.Semaphore, randrange) after the
    run had begun; --num-prompts -5, --request-rate 0, -2 or nan ran levels anyway, each of whose numbers meant
    nothing (a rate of 0 ran as a concurrency level under the name rate=0.0/s)."""
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["bench", "serve", flag, value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and "Traceback" not in err, err


def test_the_load_flags_read_lists_of_levels() -> None:
    args = build_parser().parse_args(["bench", "serve", "--concurrency", "1, 8,32", "--request-rate", "0.5,4"])
    assert args.concurrency == [1, 8, 32] and args.request_rate == [0.5, 4.0]
    args = build_parser().parse_args(["bench", "serve", "--concurrency", ""])
    assert args.concurrency == [] and args.request_rate == []


def test_a_level_whose_requests_failed_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """Against a port nobody listens on, each level printed 'failed 2' and nothing else: the reason was only in
    the JSON (--out), and without --out nowhere."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # closed at the end of the block: nobody listens there
    code = main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--concurrency", "1", "--num-prompts", "1",
                 "--input-len", "4", "--output-len", "2"])
    assert code == 1
    out = capsys.readouterr().out
    assert "failed 1" in out and "first error: ClientConnectorError" in out, out


def test_no_load_level_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--concurrency '' without --request-rate ran nothing, wrote a report of no levels and exited 0, as if it had
    measured."""
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--concurrency", ""]) == 2
    assert "no load level to run" in capsys.readouterr().err


@pytest.mark.parametrize(("command", "flag", "value"), [
    ("scheduler", "--num-seqs", "0"), ("scheduler", "--steps", "0"), ("scheduler", "--prompt-len", "-1"),
    ("scheduler", "--repetition-sizes", "-1"), ("ipc", "--num-seqs", "0"), ("ipc", "--steps", "-2")])
def test_scheduler_and_ipc_counts_are_refused_naming_the_flag(command: str, flag: str, value: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """bench scheduler --num-seqs 0 was an AssertionError traceback and --steps 0 a StatisticsError one; bench ipc
    --num-seqs 0 waited forever for a worker answer to a plan of no sequences."""
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["bench", command, flag, value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and "Traceback" not in err, err
