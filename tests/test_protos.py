"""The stubs are generated from protos/*.proto (not committed) and round-trip messages."""

from blockspec import protos


def test_stubs_generate_into_a_fresh_cache(tmp_path):
    out = protos.generate(tmp_path)
    assert (out / "blockspec_api_pb2.py").is_file() and (out / "blockspec_roles_pb2_grpc.py").is_file()
    assert protos.generate(tmp_path) == out  # same content: generated once


def test_generate_request_round_trip():
    req = protos.api_pb2.GenerateRequest(text="hello", max_tokens=8, num_speculative_tokens=3)
    back = protos.api_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.text == "hello" and back.WhichOneof("prompt") == "text" and back.num_speculative_tokens == 3
    assert protos.api_grpc.GenerationStub and protos.roles_grpc.DrafterStub and protos.roles_grpc.VerifierStub
