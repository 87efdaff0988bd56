-- Without the group column, copies of one message for several groups
-- would be delivered as many times to every consumer: refuse while there
-- are any (unbind the named groups with --purge first).
DO $pgoutbox$ BEGIN
    IF EXISTS (SELECT 1 FROM {{.Table}} WHERE consumer_group <> '') THEN
        RAISE EXCEPTION '% holds messages of named consumer groups, which version 2 cannot tell apart; unbind those groups with --purge (pgoutbox unbind) first', '{{.Table}}';
    END IF;
END $pgoutbox$;

DROP TABLE IF EXISTS {{table "_bindings"}};

CREATE INDEX IF NOT EXISTS {{idx "_ready_idx"}} ON {{.Table}} (topic, available_at, id) WHERE lease_token IS NULL;

CREATE INDEX IF NOT EXISTS {{idx "_lease_idx"}} ON {{.Table}} (topic, leased_until) WHERE lease_token IS NOT NULL;

CREATE UNIQUE INDEX IF NOT EXISTS {{idx "_dedup_idx"}} ON {{.Table}} (topic, dedup_key) WHERE dedup_key IS NOT NULL;

DROP INDEX IF EXISTS {{qidx "_group_ready_idx"}}, {{qidx "_group_lease_idx"}}, {{qidx "_group_dedup_idx"}};

ALTER TABLE {{.Table}} DROP COLUMN IF EXISTS consumer_group;
{{- if .DLQ}}

ALTER TABLE {{.DLQ}} DROP COLUMN IF EXISTS consumer_group;
{{- end}}
