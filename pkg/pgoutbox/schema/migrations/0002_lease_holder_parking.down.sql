-- Parked messages stay in the table, never due, without their reason.
ALTER TABLE {{.Table}}
    DROP COLUMN IF EXISTS failure_reason,
    DROP COLUMN IF EXISTS lease_holder;
