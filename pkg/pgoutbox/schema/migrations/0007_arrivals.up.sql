-- Arrivals (Config.Arrivals): plain messages of publishers that set it
-- arrive here, a table of what a message is with one index; subscribers
-- that set it give them their groups and delivery state. Every outbox
-- has the table from this version on; it stays empty while no publisher
-- sets Arrivals. Its ids come from the outbox's identity, so an arrival
-- keeps its id when it moves into the outbox. A rotating outbox (made
-- from this table by ConvertToRotating) has none: it takes every message
-- into its ring.
DO $pgoutbox$ BEGIN
    IF to_regclass('{{table "_arrivals"}}') IS NULL
       AND (SELECT relkind FROM pg_catalog.pg_class WHERE oid = '{{.Table}}'::regclass) <> 'p' THEN
        EXECUTE format('CREATE TABLE {{table "_arrivals"}} (
    id         bigint      NOT NULL DEFAULT nextval(%L::regclass),
    topic      text        NOT NULL,
    uuid       text        NOT NULL,
    payload    bytea       NOT NULL,
    metadata   jsonb       NOT NULL DEFAULT ''{}'',
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT {{arrivalsPkey}} PRIMARY KEY (topic, id)
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02
)', pg_get_serial_sequence('{{.Table}}', 'id'));
    END IF;
END $pgoutbox$;
-- The arrival id from which a binding's group receives arrivals.
ALTER TABLE {{table "_bindings"}} ADD COLUMN IF NOT EXISTS arrivals_from bigint NOT NULL DEFAULT 0;
