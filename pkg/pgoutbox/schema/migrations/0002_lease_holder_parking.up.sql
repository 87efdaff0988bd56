-- lease_holder: the liveness lock of the process holding a lease, so a
-- dead consumer's rows come back without waiting for the lease to expire.
-- failure_reason: why a message is parked (no dead-letter table).
ALTER TABLE {{.Table}}
    ADD COLUMN IF NOT EXISTS lease_holder bigint,
    ADD COLUMN IF NOT EXISTS failure_reason text;
