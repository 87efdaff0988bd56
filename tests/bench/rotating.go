package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// rotatingSystem ("pgoutbox-rotating") is an experiment for the storage
// layout of a future release, run by the unchanged library: the outbox is a
// table partitioned by the time a row was stored (stored_at, the server's
// clock_timestamp() at the insert), one partition per rotationWindow, plus
// a "long" partition below 2000-01-01 for rows that outlive their window.
// A rotator creates the partitions ahead, moves the rows of a window that
// ended which are due after the next window (timers, retries backing off;
// never a locked, leased or ready row) to the long partition, and detaches
// and drops a window once its ready rows are consumed, which
// frees its space whatever snapshots are open, where DELETE and VACUUM
// cannot while one is held. Dedup keys are left out (a unique index of a
// partitioned table must contain the partition key); the soak scenarios
// use none.
type rotatingSystem struct{}

const (
	rotatingName = "pgoutbox-rotating"
	// rotationWindow is how long one partition takes the new rows.
	rotationWindow = 10 * time.Second
	// longBelow bounds the long partition; rows moved there get
	// longStoredAt as stored_at.
	longBelow    = "2000-01-01 00:00:00+00"
	longStoredAt = `'` + longBelow + `'::timestamptz - interval '1 second'`
)

func (rotatingSystem) name() string { return rotatingName }

func (rotatingSystem) newInstance(ctx context.Context, b *bench, schemaName string) (instance, error) {
	tables := schema.Config{Schema: schemaName, Table: "outbox"}
	parent := pgx.Identifier{schemaName, "outbox"}.Sanitize()
	// The columns, defaults and identity come from the library's own DDL,
	// applied to a template table; the partitioned outbox adds stored_at
	// and a primary key that holds it. The library's DDL then adds what
	// is missing (its indexes become partitioned indexes, created on
	// every partition) and leaves the table; the dedup index it would add
	// needs the partition key in it.
	tmpl := schema.Config{Schema: schemaName + "_template", Table: "outbox"}
	if err := schema.Create(ctx, tx.FromPgxPool(b.pool), tmpl); err != nil {
		return nil, err
	}
	stmts := []string{
		`CREATE SCHEMA IF NOT EXISTS ` + pgx.Identifier{schemaName}.Sanitize(),
		`CREATE TABLE ` + parent + ` (LIKE ` + pgx.Identifier{tmpl.Schema, tmpl.Table}.Sanitize() + ` INCLUDING DEFAULTS INCLUDING IDENTITY,
    stored_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (id, stored_at)
) PARTITION BY RANGE (stored_at)`,
		`DROP SCHEMA ` + pgx.Identifier{tmpl.Schema}.Sanitize() + ` CASCADE`,
		`CREATE TABLE ` + pgx.Identifier{schemaName, "outbox_long"}.Sanitize() + ` PARTITION OF ` + parent +
			` FOR VALUES FROM (MINVALUE) TO ('` + longBelow + `')`,
		`CREATE UNIQUE INDEX outbox_group_dedup_idx ON ` + parent + ` (topic, consumer_group, dedup_key, stored_at) WHERE dedup_key IS NOT NULL`,
	}
	for _, s := range stmts {
		if _, err := b.pool.Exec(ctx, s); err != nil {
			return nil, fmt.Errorf("rotating outbox: %w", err)
		}
	}
	r := &rotator{b: b, schema: schemaName, parent: parent, attached: map[int64]bool{}}
	if err := r.ensureAhead(ctx); err != nil {
		return nil, err
	}
	if err := schema.Create(ctx, tx.FromPgxPool(b.pool), tables); err != nil {
		return nil, err
	}
	return &rotatingInstance{pgoutboxInstance: &pgoutboxInstance{b: b, tables: tables}, rot: r}, nil
}

// rotatingInstance is a pgoutbox instance whose consumer runs a rotator
// beside it (this file's, or generations.go's).
type rotatingInstance struct {
	*pgoutboxInstance
	rot interface{ run(context.Context) }
}

func (i *rotatingInstance) consumer(ctx context.Context, cfg consumeConfig) (consumer, error) {
	c, err := i.pgoutboxInstance.consumer(ctx, cfg)
	if err != nil {
		return nil, err
	}
	return &rotatingConsumer{consumer: c, rot: i.rot}, nil
}

type rotatingConsumer struct {
	consumer
	rot  interface{ run(context.Context) }
	stop context.CancelFunc
	done chan struct{}
	once sync.Once
}

func (c *rotatingConsumer) start(ctx context.Context) error {
	if err := c.consumer.start(ctx); err != nil {
		return err
	}
	rctx, stop := context.WithCancel(context.Background())
	c.stop, c.done = stop, make(chan struct{})
	go func() {
		defer close(c.done)
		c.rot.run(rctx)
	}()
	return nil
}

func (c *rotatingConsumer) close() error {
	c.once.Do(func() {
		if c.stop != nil {
			c.stop()
			<-c.done
		}
	})
	return c.consumer.close()
}

// rotator keeps the window partitions of one rotating outbox. Only its
// goroutine (run) touches it once the consumer started.
type rotator struct {
	b              *bench
	schema, parent string
	attached       map[int64]bool // windows (unix seconds of their start) with a partition
}

func (r *rotator) partition(w int64) string {
	return pgx.Identifier{r.schema, fmt.Sprintf("outbox_w%d", w)}.Sanitize()
}

func windowOf(t time.Time) int64 {
	s := int64(rotationWindow / time.Second)
	return t.Unix() / s * s
}

// ensureAhead creates the partitions of the current window and the next
// two, so a row always has one: a missing partition fails the INSERT.
func (r *rotator) ensureAhead(ctx context.Context) error {
	step := int64(rotationWindow / time.Second)
	now := windowOf(time.Now())
	for w := now; w <= now+2*step; w += step {
		if r.attached[w] {
			continue
		}
		from, to := time.Unix(w, 0).UTC().Format(time.RFC3339), time.Unix(w+step, 0).UTC().Format(time.RFC3339)
		// Created apart and then attached: CREATE TABLE ... PARTITION OF
		// takes an ACCESS EXCLUSIVE lock on the outbox, which waits for the
		// open held batches while every publish and claim waits behind it
		// (a 1 s stall each window); ATTACH takes SHARE UPDATE EXCLUSIVE,
		// which lets them run. The attach builds the partition's indexes.
		part := r.partition(w)
		if _, err := r.b.pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+part+` (LIKE `+r.parent+` INCLUDING DEFAULTS INCLUDING CONSTRAINTS)`); err != nil {
			return fmt.Errorf("create partition: %w", err)
		}
		if _, err := r.b.pool.Exec(ctx, `ALTER TABLE `+r.parent+` ATTACH PARTITION `+part+` FOR VALUES FROM ('`+from+`') TO ('`+to+`')`); err != nil {
			return fmt.Errorf("attach partition: %w", err)
		}
		r.attached[w] = true
	}
	return nil
}

// run rotates every half window until ctx ends.
func (r *rotator) run(ctx context.Context) {
	t := time.NewTicker(rotationWindow / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := r.rotate(ctx); err != nil && ctx.Err() == nil {
			fmt.Fprintf(r.b.progress, "  rotator: %v\n", err)
		}
	}
}

// rotate creates partitions ahead, and for every window that ended a whole
// window ago moves its rows due after the next window to the long
// partition and, once it is empty, detaches and drops it.
func (r *rotator) rotate(ctx context.Context) error {
	if err := r.ensureAhead(ctx); err != nil {
		return err
	}
	step := int64(rotationWindow / time.Second)
	cutoff := windowOf(time.Now()) - step // windows before this one ended a window ago
	for w := range r.attached {
		if w >= cutoff {
			continue
		}
		part := r.partition(w)
		// Only rows due after the next window move: the ready ones (a
		// backlog) and the leased ones stay where claims and acks find
		// them, and the window waits until they are consumed. A claim or
		// an ack that meets a row moved under it fails ("already moved to
		// another partition"), and moving a backlog made every claim race
		// the mover.
		if _, err := r.b.pool.Exec(ctx, `UPDATE `+r.parent+` o SET stored_at = `+longStoredAt+`
  FROM (SELECT id, stored_at FROM `+part+`
         WHERE lease_token IS NULL AND available_at > now() + make_interval(secs => $1)
           FOR UPDATE SKIP LOCKED) m
 WHERE o.id = m.id AND o.stored_at = m.stored_at`, rotationWindow.Seconds()); err != nil {
			return fmt.Errorf("move stragglers of %s: %w", part, err)
		}
		var empty bool
		if err := r.b.pool.QueryRow(ctx, `SELECT NOT EXISTS (SELECT FROM `+part+`)`).Scan(&empty); err != nil {
			return err
		}
		if !empty {
			continue // locked rows (held, being acked): next time
		}
		// Concurrently: claims and publishes on the parent go on; it waits
		// for the transactions that use the outbox now.
		if _, err := r.b.pool.Exec(ctx, `ALTER TABLE `+r.parent+` DETACH PARTITION `+part+` CONCURRENTLY`); err != nil {
			return fmt.Errorf("detach %s: %w", part, err)
		}
		delete(r.attached, w)
		// A row committed while the detach waited stays in the detached
		// table: put it back before dropping.
		cols := outboxColumnList()
		if _, err := r.b.pool.Exec(ctx, `INSERT INTO `+r.parent+` (`+cols+`, stored_at) OVERRIDING SYSTEM VALUE
SELECT `+cols+`, `+longStoredAt+` FROM `+part); err != nil {
			return fmt.Errorf("rows of detached %s back: %w", part, err)
		}
		if _, err := r.b.pool.Exec(ctx, `DROP TABLE `+part); err != nil {
			return fmt.Errorf("drop %s: %w", part, err)
		}
	}
	return nil
}

// outboxColumnList is the outbox's columns, comma-separated.
func outboxColumnList() string {
	names := make([]string, len(query.OutboxColumns))
	for i, c := range query.OutboxColumns {
		names[i] = c.Name
	}
	return strings.Join(names, ", ")
}
