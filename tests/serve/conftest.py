"""Fixtures for the serving tests: one run folder, the real `tinylm serve` on it, and clients.

The run and the command server are made once per session: starting the server costs a Python
start-up with torch and FastAPI (a second or two), and every test talks to it over HTTP as a
user's client would.
"""

from __future__ import annotations

import openai
import pytest
from servekit import CommandServer, make_run

from tinylm.run import load_run


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("serve") / "tiny-run")


@pytest.fixture(scope="session")
def run(run_dir):
    """The same run, loaded in the test process: the library side of every comparison."""
    return load_run(run_dir)


@pytest.fixture(scope="session")
def server(run_dir, tmp_path_factory):
    """`tinylm serve --run DIR --port 0` in a subprocess (batching on, no API key)."""
    served = CommandServer(run_dir, tmp_path_factory.mktemp("serve-logs"))
    yield served
    served.close()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    """The official OpenAI client, pointed at the server (it requires some key; the server asks for none)."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
