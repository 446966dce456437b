"""Fixtures of the deployment tests: ONE CDK synthesis for the whole session (a synthesis takes ~10 s;
every template, nag and lint test reads this one)."""

from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="CDK app requirements (requirements.txt) not installed")

from deploy_support import Synthesis  # noqa: E402


@pytest.fixture(scope="session")
def synthesis(tmp_path_factory) -> Synthesis:
    return Synthesis(tmp_path_factory.mktemp("cdk.out"))
