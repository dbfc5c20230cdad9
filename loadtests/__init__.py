"""Load generator and benchmark reports for any OpenAI-compatible server."""
