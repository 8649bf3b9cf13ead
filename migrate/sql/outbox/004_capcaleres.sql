-- Headers to publish with the event (CONTRACT.md): a flat JSON object of
-- string values, e.g. the W3C traceparent and tracestate of the writer's
-- trace. Optional: a writer that does not know the column (the Python
-- services) leaves it NULL, and the relay then publishes the contract's
-- headers only. Adding a nullable column without a default rewrites nothing.
ALTER TABLE {{outbox}} ADD COLUMN IF NOT EXISTS capcaleres JSONB;
