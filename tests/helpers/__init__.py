"""What the tests share, as plain code (no test module imports another, and nothing imports conftest):
verifiers and drafters built at test time, prepared data and features, the loopback Hub and OpenAI servers,
the verifier families, and assertions. Fixtures over these live in tests/conftest.py."""
