"""schemathesis fuzzes every route from the OpenAPI schema against real processes serving the
synthetic model: no request it makes gets a 500. (A 503, or a 504 to a deadline the fuzzer chose
in milliseconds, is an answer rather than a server error; each must still be in an error format.)

Driven through schemathesis' hypothesis strategies (`as_strategy`), one operation at a time,
rather than its pytest plugin, which does not run under pytest 9."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.schemas import OpenApiSchema

from tests.helpers import RedisServer, Stack

pytestmark = pytest.mark.slow
EXAMPLES_PER_OPERATION = 40


@pytest.fixture(scope="module")
def api_schema(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenApiSchema]:
    stack = Stack(redis_server.url, tmp_path_factory.mktemp("fuzz"), key_prefix="fuzz", served_models="synthetic",
                  block_ms=200, heartbeat_interval_ms=200, heartbeat_ttl_ms=1500, shutdown_grace_s=5)
    try:
        stack.start_gateway()
        stack.start_worker(model="synthetic", models__synthetic__params='{"batch_ms": 0, "item_ms": 0}')
        asyncio.run(stack.wait_ready(60))
        yield schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    finally:
        stack.stop()


def test_no_route_answers_500(api_schema: OpenApiSchema) -> None:
    statuses: dict[int, int] = {}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        def call(case: schemathesis.Case) -> None:
            response = case.call(timeout=30)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code != 500, (case.as_curl_command(), response.text[:300])
            if response.status_code >= 500:
                assert response.status_code in (503, 504) and "error" in response.json(), response.text[:300]

        call()
    print(f"statuses over {len(operations)} operations: {dict(sorted(statuses.items()))}")
