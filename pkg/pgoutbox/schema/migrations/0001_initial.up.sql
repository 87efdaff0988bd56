-- The first released layout: the outbox, its ready, lease and dedup
-- indexes, and the dead-letter table.
{{- if .CreateSchema}}
{{createSchema}};
{{- end}}

-- A queue table is mostly dead tuples (every claim and every ack leaves
-- one): autovacuum visits it after 1% churn instead of the default 20%.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic        text        NOT NULL,
    uuid         text        NOT NULL,
    payload      bytea       NOT NULL,
    metadata     jsonb       NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(),
    deliveries   integer     NOT NULL DEFAULT 0,
    lease_token  uuid,
    leased_until timestamptz,
    leased_by    text,
    dedup_key    text,
    last_error   text
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02
);

CREATE INDEX IF NOT EXISTS {{idx "_ready_idx"}} ON {{.Table}} (topic, available_at, id) WHERE lease_token IS NULL;

CREATE INDEX IF NOT EXISTS {{idx "_lease_idx"}} ON {{.Table}} (topic, leased_until) WHERE lease_token IS NOT NULL;

CREATE UNIQUE INDEX IF NOT EXISTS {{idx "_dedup_idx"}} ON {{.Table}} (topic, dedup_key) WHERE dedup_key IS NOT NULL;
{{- if .DLQ}}

CREATE TABLE IF NOT EXISTS {{.DLQ}} (
    id             bigint      PRIMARY KEY,
    topic          text        NOT NULL,
    uuid           text        NOT NULL,
    payload        bytea       NOT NULL,
    metadata       jsonb       NOT NULL,
    created_at     timestamptz NOT NULL,
    deliveries     integer     NOT NULL,
    dedup_key      text,
    last_error     text,
    failure_reason text        NOT NULL,
    failed_by      text,
    failed_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS {{dlqidx "_topic_failed_at_idx"}} ON {{.DLQ}} (topic, failed_at);
{{- end}}
