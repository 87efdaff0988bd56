-- Consumer groups: every row is for one group ('' is the default group).
-- A constant default makes the new column a catalog change, not a rewrite
-- of a full table.
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS consumer_group text NOT NULL DEFAULT '';
{{- if .DLQ}}

ALTER TABLE {{.DLQ}} ADD COLUMN IF NOT EXISTS consumer_group text NOT NULL DEFAULT '';
{{- end}}

-- Ready rows of a topic and group, in delivery order; the claim's "ready"
-- branch scans it.
CREATE INDEX IF NOT EXISTS {{idx "_group_ready_idx"}} ON {{.Table}} (topic, consumer_group, available_at, id) WHERE lease_token IS NULL;

-- Leased rows by expiry; the claim's "expired" branch scans it.
CREATE INDEX IF NOT EXISTS {{idx "_group_lease_idx"}} ON {{.Table}} (topic, consumer_group, leased_until) WHERE lease_token IS NOT NULL;

-- Timer / idempotency keys: unique per topic and group while the row
-- exists (every group gets its own copy of a keyed message).
CREATE UNIQUE INDEX IF NOT EXISTS {{idx "_group_dedup_idx"}} ON {{.Table}} (topic, consumer_group, dedup_key) WHERE dedup_key IS NOT NULL;

-- The first release's indexes, without the group: the unique one would
-- refuse a keyed message's copy for a second group.
DROP INDEX IF EXISTS {{qidx "_ready_idx"}}, {{qidx "_lease_idx"}}, {{qidx "_dedup_idx"}};

CREATE TABLE IF NOT EXISTS {{table "_bindings"}} (
    topic          text        NOT NULL,
    consumer_group text        NOT NULL,
    bound_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, consumer_group)
);

-- The rows already there are for the default group, whose subscribers
-- never bound: bind it to their topics, so binding a new group later does
-- not stop the copies the running consumers get.
INSERT INTO {{table "_bindings"}} (topic, consumer_group)
SELECT DISTINCT topic, consumer_group FROM {{.Table}}
ON CONFLICT DO NOTHING;
