-- The subscriber's ack in four shapes, timed by EXPLAIN ANALYZE on a table
-- of leased rows (docs/performance.md, "The ack as one index walk"):
--   cur    the earlier form: a LATERAL probe per (id, token), then a delete by ctid
--   pos    one walk of the primary key, tokens paired by array_position (a linear search)
--   bin    the ack as it is: the same walk, tokens paired by width_bucket over the
--          sorted ids (a binary search; the subscriber sorts an ack's pairs by id)
--   raw    a hand-written DELETE ... USING unnest(ids, tokens) join
-- Run against a scratch database:
--   psql "$DSN" -v stmt=pos -v start=5000 -v n=100 -f tests/bench/sql/ack-shapes.sql
-- once per shape, alternating, with several values of start; each run rolls
-- its delete back. The table is made on the first run (200,000 rows, each
-- leased under a token of its own).
\set ON_ERROR_STOP on
CREATE SCHEMA IF NOT EXISTS ackbench;
SELECT NOT EXISTS (SELECT FROM pg_class WHERE oid = to_regclass('ackbench.o')) AS fresh \gset
\if :fresh
CREATE TABLE ackbench.o (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, topic text NOT NULL,
    consumer_group text NOT NULL DEFAULT '', uuid text NOT NULL, payload bytea NOT NULL,
    lease_token uuid, leased_until timestamptz, available_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX o_ready ON ackbench.o (topic, consumer_group, available_at, id) WHERE lease_token IS NULL;
CREATE INDEX o_lease ON ackbench.o (topic, consumer_group, leased_until) WHERE lease_token IS NOT NULL;
INSERT INTO ackbench.o (topic, uuid, payload, lease_token, leased_until)
SELECT 't', g::text, convert_to(repeat('x', 200), 'UTF8'), gen_random_uuid(), now() FROM generate_series(1, 200000) g;
VACUUM ANALYZE ackbench.o;
\endif
-- As the subscriber plans its writes: generic plans, the write settings.
SET plan_cache_mode = force_generic_plan;
SET enable_seqscan = off; SET enable_bitmapscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off; SET jit = off;
PREPARE cur(bigint[], uuid[]) AS DELETE FROM ackbench.o o
 WHERE o.ctid = ANY (ARRAY(
         SELECT r.ctid FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token)
          CROSS JOIN LATERAL (SELECT ctid FROM ackbench.o l
                               WHERE l.id = c.id AND l.lease_token IS NOT DISTINCT FROM c.token AND c.token IS NOT NULL
                               LIMIT 1) r))
   AND o.id = ANY ($1::bigint[])
   AND coalesce(o.lease_token, '00000000-0000-0000-0000-000000000000') = ANY ($2::uuid[])
RETURNING o.id, o.lease_token;
PREPARE pos(bigint[], uuid[]) AS DELETE FROM ackbench.o o
 WHERE o.id = ANY ($1::bigint[])
   AND coalesce(o.lease_token, '00000000-0000-0000-0000-000000000000') = ($2::uuid[])[array_position($1::bigint[], o.id)]
RETURNING o.id, o.lease_token;
PREPARE bin(bigint[], uuid[]) AS DELETE FROM ackbench.o o
 WHERE o.id = ANY ($1::bigint[])
   AND coalesce(o.lease_token, '00000000-0000-0000-0000-000000000000') = ($2::uuid[])[width_bucket(o.id, $1::bigint[])]
RETURNING o.id, o.lease_token;
PREPARE raw(bigint[], uuid[]) AS DELETE FROM ackbench.o o USING unnest($1::bigint[], $2::uuid[]) AS c(id, token)
 WHERE o.id = c.id AND o.lease_token = c.token;
SELECT array_agg(id ORDER BY id) AS ids, array_agg(lease_token ORDER BY id) AS toks
  FROM ackbench.o WHERE id BETWEEN :start AND :start + :n - 1 \gset
BEGIN;
EXPLAIN (ANALYZE, TIMING OFF, COSTS OFF, SUMMARY ON) EXECUTE :stmt(:'ids', :'toks');
ROLLBACK;
