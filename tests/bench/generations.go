package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// generationsSystem ("pgoutbox-generations") is the second rotation
// experiment, run by the unchanged library like pgoutbox-rotating: the
// outbox is partitioned by a generation number, not by time, over a fixed
// ring of generationCount partitions. A row's generation is its column's
// default, the last value of a sequence modulo the ring's size, so an insert
// needs no partition made ahead for it: when nothing rotates, every row goes
// on into the current partition and the outbox is today's single table. The
// rotator advances the sequence once the next partition of the ring is
// empty, moves the rows of older partitions that are due after the next
// window (timers, retries backing off) to the current one, and empties an
// older partition that has no row left with TRUNCATE, which frees its space
// whatever snapshots are open. TRUNCATE takes ACCESS EXCLUSIVE on that
// partition, and every claim locks all partitions: it waits at most
// generationLockTimeout, then tries again at the next tick. The emptiness is
// checked again once the lock is held, so a row committed by a publisher
// that chose the partition before the advance is never truncated. As in
// pgoutbox-rotating, dedup keys are left out (a unique index of a
// partitioned table must contain the partition key).
type generationsSystem struct{}

const (
	generationsName = "pgoutbox-generations"
	// generationCount is the ring: the partition written, the one that
	// drains, and an empty one to advance into.
	generationCount = 3
	// generationWindow is how long a partition stays the current one.
	generationWindow = 10 * time.Second
	// generationLockTimeout bounds how long a TRUNCATE queues for its lock
	// (claims and publishes queue behind it meanwhile).
	generationLockTimeout = 50 * time.Millisecond
)

func (generationsSystem) name() string { return generationsName }

func (generationsSystem) newInstance(ctx context.Context, b *bench, schemaName string) (instance, error) {
	tables := schema.Config{Schema: schemaName, Table: "outbox"}
	parent := pgx.Identifier{schemaName, "outbox"}.Sanitize()
	seq := pgx.Identifier{schemaName, "outbox_generation"}.Sanitize()
	// The columns, defaults and identity come from the library's DDL on a
	// template table, as in rotating.go.
	tmpl := schema.Config{Schema: schemaName + "_template", Table: "outbox"}
	if err := schema.Create(ctx, tx.FromPgxPool(b.pool), tmpl); err != nil {
		return nil, err
	}
	stmts := []string{
		`CREATE SCHEMA IF NOT EXISTS ` + pgx.Identifier{schemaName}.Sanitize(),
		`CREATE SEQUENCE ` + seq + ` MINVALUE 0 START 0`,
		`SELECT setval('` + seq + `', 0, true)`, // last_value is NULL until called
		`CREATE TABLE ` + parent + ` (LIKE ` + pgx.Identifier{tmpl.Schema, tmpl.Table}.Sanitize() + ` INCLUDING DEFAULTS INCLUDING IDENTITY,
    generation smallint NOT NULL DEFAULT (pg_sequence_last_value('` + seq + `') % ` + fmt.Sprint(generationCount) + `)::smallint,
    PRIMARY KEY (id, generation)
) PARTITION BY LIST (generation)`,
		`DROP SCHEMA ` + pgx.Identifier{tmpl.Schema}.Sanitize() + ` CASCADE`,
		`CREATE UNIQUE INDEX outbox_group_dedup_idx ON ` + parent + ` (topic, consumer_group, dedup_key, generation) WHERE dedup_key IS NOT NULL`,
	}
	g := &generations{b: b, parent: parent, seq: seq}
	for i := range generationCount {
		g.parts = append(g.parts, pgx.Identifier{schemaName, fmt.Sprintf("outbox_g%d", i)}.Sanitize())
		stmts = append(stmts, fmt.Sprintf(`CREATE TABLE %s PARTITION OF %s FOR VALUES IN (%d)`, g.parts[i], parent, i))
	}
	for _, s := range stmts {
		if _, err := b.pool.Exec(ctx, s); err != nil {
			return nil, fmt.Errorf("generations outbox: %w", err)
		}
	}
	if err := schema.Create(ctx, tx.FromPgxPool(b.pool), tables); err != nil {
		return nil, err
	}
	g.since = time.Now()
	return &rotatingInstance{pgoutboxInstance: &pgoutboxInstance{b: b, tables: tables}, rot: g}, nil
}

// generations rotates one generations outbox. Only its goroutine (run)
// touches it once the consumer started.
type generations struct {
	b           *bench
	parent, seq string
	parts       []string  // the ring's partitions, by generation
	since       time.Time // when the current generation became current
	truncated   int       // partitions emptied, for the progress line
	lockMissed  int       // TRUNCATEs that did not get their lock in time
}

func (g *generations) run(ctx context.Context) {
	t := time.NewTicker(generationWindow / 5)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			fmt.Fprintf(g.b.progress, "  generations: %d partitions truncated, %d lock timeouts\n", g.truncated, g.lockMissed)
			return
		case <-t.C:
		}
		if err := g.rotate(ctx); err != nil && ctx.Err() == nil {
			fmt.Fprintf(g.b.progress, "  generations: %v\n", err)
		}
	}
}

// rotate empties what it can of the older partitions, then advances into
// the next one when it is empty and the current one has had its window.
func (g *generations) rotate(ctx context.Context) error {
	var last int64
	if err := g.b.pool.QueryRow(ctx, `SELECT pg_sequence_last_value('`+g.seq+`')`).Scan(&last); err != nil {
		return err
	}
	cur := int(last % generationCount)
	emptyNext := false
	for k := 1; k < generationCount; k++ { // the oldest first: cur+1 is the next to be written
		p := (cur + k) % generationCount
		empty, err := g.drain(ctx, p, cur)
		if err != nil {
			return err
		}
		if k == 1 {
			emptyNext = empty
		}
	}
	if emptyNext && time.Since(g.since) >= generationWindow {
		if _, err := g.b.pool.Exec(ctx, `SELECT nextval('`+g.seq+`')`); err != nil {
			return err
		}
		g.since = time.Now()
	}
	return nil
}

// drain moves partition p's rows due after the next window to partition
// cur and truncates p when nothing is left in it; it reports whether p is
// empty.
func (g *generations) drain(ctx context.Context, p, cur int) (bool, error) {
	part := g.parts[p]
	if _, err := g.b.pool.Exec(ctx, `UPDATE `+g.parent+` o SET generation = $1
  FROM (SELECT id FROM `+part+`
         WHERE lease_token IS NULL AND available_at > now() + make_interval(secs => $2)
           FOR UPDATE SKIP LOCKED) m
 WHERE o.id = m.id AND o.generation = $3`, cur, generationWindow.Seconds(), p); err != nil {
		return false, fmt.Errorf("move stragglers of %s: %w", part, err)
	}
	var any bool
	if err := g.b.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM `+part+`)`).Scan(&any); err != nil {
		return false, err
	}
	if any {
		return false, nil
	}
	var size int64
	if err := g.b.pool.QueryRow(ctx, `SELECT pg_relation_size('`+part+`')`).Scan(&size); err != nil {
		return false, err
	}
	if size == 0 {
		return true, nil // truncated already
	}
	err := pgx.BeginFunc(ctx, g.b.pool, func(t pgx.Tx) error {
		if _, err := t.Exec(ctx, fmt.Sprintf(`SET LOCAL lock_timeout = %d`, generationLockTimeout.Milliseconds())); err != nil {
			return err
		}
		if _, err := t.Exec(ctx, `LOCK TABLE `+part+` IN ACCESS EXCLUSIVE MODE`); err != nil {
			return err
		}
		// Again under the lock: a publisher that read the generation
		// before the advance may have committed into p since.
		if err := t.QueryRow(ctx, `SELECT EXISTS (SELECT FROM `+part+`)`).Scan(&any); err != nil || any {
			return err
		}
		_, err := t.Exec(ctx, `TRUNCATE `+part)
		return err
	})
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "55P03": // lock_not_available
		g.lockMissed++
		return false, nil
	case err != nil:
		return false, fmt.Errorf("truncate %s: %w", part, err)
	case any:
		return false, nil
	}
	g.truncated++
	return true, nil
}
