-- The keyed claim's check of its window, in two shapes, by EXPLAIN ANALYZE
-- (buffers) on a fixed state (docs/performance.md, "Keyed claims check each
-- key once"): an outbox made by `pgoutbox schema apply --schema keybench`,
-- 4,000 waiting rows over :keys keys (default 8), the oldest row of every
-- other key leased (in flight), and a window of the 256 oldest waiting rows:
--   each   every row of the window checked (the earlier form)
--   oldest only each key's oldest row of the window checked (the form now)
-- Both return the same rows (the first two results: the next message of
-- each key not in flight). Run against a scratch database:
--   go run ./cmd/pgoutbox schema apply --dsn "$DSN" --schema keybench
--   psql "$DSN" -v keys=8 -f tests/bench/sql/key-window.sql
\set ON_ERROR_STOP on
\if :{?keys}
\else
\set keys 8
\endif
TRUNCATE keybench.outbox;
INSERT INTO keybench.outbox (topic, uuid, payload, ordering_key)
SELECT 't', gen_random_uuid()::text, 'x', 'k' || (g % :keys) FROM generate_series(1, 4000) g;
UPDATE keybench.outbox SET lease_token = gen_random_uuid(), leased_until = now() + interval '1h'
 WHERE id IN (SELECT min(id) FROM keybench.outbox GROUP BY ordering_key HAVING min(id) % 2 = 0);
VACUUM ANALYZE keybench.outbox;
SET plan_cache_mode = force_generic_plan; SET jit = off; SET enable_bitmapscan = off; SET enable_seqscan = off;
PREPARE each(text, text) AS
WITH scan AS MATERIALIZED (
    SELECT id, available_at, ordering_key FROM keybench.outbox
     WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NULL AND available_at <= now()
     ORDER BY available_at, id LIMIT 256)
SELECT array_agg(c.id ORDER BY c.id) FROM scan c
 WHERE (c.ordering_key IS NULL OR NOT (
        EXISTS (SELECT 1 FROM keybench.outbox k WHERE k.topic = $1 AND k.consumer_group = $2
                   AND k.ordering_key = c.ordering_key AND k.id < c.id AND k.available_at < 'infinity')
     OR EXISTS (SELECT 1 FROM keybench.outbox l WHERE l.topic = $1 AND l.consumer_group = $2
                   AND l.ordering_key = c.ordering_key AND l.lease_token IS NOT NULL AND l.id <> c.id)));
PREPARE oldest(text, text) AS
WITH scan AS MATERIALIZED (
    SELECT id, available_at, ordering_key FROM keybench.outbox
     WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NULL AND available_at <= now()
     ORDER BY available_at, id LIMIT 256)
SELECT array_agg(c.id ORDER BY c.id)
  FROM (SELECT id, ordering_key, row_number() OVER (PARTITION BY ordering_key ORDER BY id) AS nth FROM scan) c
 WHERE (c.ordering_key IS NULL OR c.nth = 1) AND (c.ordering_key IS NULL OR NOT (
        EXISTS (SELECT 1 FROM keybench.outbox k WHERE k.topic = $1 AND k.consumer_group = $2
                   AND k.ordering_key = c.ordering_key AND k.id < c.id AND k.available_at < 'infinity')
     OR EXISTS (SELECT 1 FROM keybench.outbox l WHERE l.topic = $1 AND l.consumer_group = $2
                   AND l.ordering_key = c.ordering_key AND l.lease_token IS NOT NULL AND l.id <> c.id)));
EXECUTE each('t', '');
EXECUTE oldest('t', '');
EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, COSTS OFF) EXECUTE each('t', '');
EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, COSTS OFF) EXECUTE oldest('t', '');
