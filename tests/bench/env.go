package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// connect opens the shared pool on the benchmark database, creating the
// database first if it is missing.
func (b *bench) connect(ctx context.Context) error {
	cfg, err := pgx.ParseConfig(b.opts.dsn)
	if err != nil {
		return fmt.Errorf("parse -dsn: %w", err)
	}
	if cfg.Database != benchDB {
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			return fmt.Errorf("connect to %s: %w", cfg.Database, err)
		}
		var exists bool
		err = conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, benchDB).Scan(&exists)
		if err == nil && !exists {
			_, err = conn.Exec(ctx, `CREATE DATABASE `+benchDB)
		}
		_ = conn.Close(ctx)
		if err != nil {
			return fmt.Errorf("create database %s: %w", benchDB, err)
		}
	}
	pcfg, err := pgxpool.ParseConfig(b.opts.dsn)
	if err != nil {
		return fmt.Errorf("parse -dsn: %w", err)
	}
	pcfg.ConnConfig.Database = benchDB
	pcfg.MaxConns = poolSize
	b.connCfg = pcfg.ConnConfig.Copy()
	if b.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return err
	}
	if err := b.pool.Ping(ctx); err != nil {
		return err
	}
	b.postmaster = findPostmaster(ctx, b.pool)
	return nil
}

// conn opens a dedicated connection (publishers, the raw floor's loops).
func (b *bench) conn(ctx context.Context) (*pgx.Conn, error) {
	return pgx.ConnectConfig(ctx, b.connCfg.Copy())
}

// printConditions prints what the README needs to state the conditions of
// the numbers.
func (b *bench) printConditions(ctx context.Context, w io.Writer) error {
	settings := []string{"server_version", "synchronous_commit", "fsync", "shared_buffers", "max_connections"}
	vals := make([]string, len(settings))
	for i, s := range settings {
		if err := b.pool.QueryRow(ctx, `SELECT current_setting($1)`, s).Scan(&vals[i]); err != nil {
			return fmt.Errorf("read setting %s: %w", s, err)
		}
	}
	fmt.Fprintf(w, "pgoutbox bench  %s\n", time.Now().Format(time.RFC3339))
	fmt.Fprintf(w, "go %s  GOMAXPROCS=%d  nproc=%d  %s/%s  load average %s\n", runtime.Version(), runtime.GOMAXPROCS(0), runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, loadavg())
	fmt.Fprintf(w, "postgres %s  synchronous_commit=%s  fsync=%s  shared_buffers=%s  max_connections=%s  (database %s on %s:%d)\n",
		vals[0], vals[1], vals[2], vals[3], vals[4], benchDB, b.connCfg.Host, b.connCfg.Port)
	commit := "asynchronous (pgoutbox default)"
	if b.opts.syncCommit {
		commit = "synchronous (-sync-commit)"
	}
	fmt.Fprintf(w, "repeat=%d  scale=%g  backlog-large=%d  pool=%d conns  pgoutbox/raw claim+ack commits: %s\n\n",
		b.opts.repeat, b.opts.scale, b.count(b.opts.backlogLarge), poolSize, commit)
	return nil
}

// dropLeftovers removes the schemas of an interrupted earlier run; the
// database belongs to the benchmark, so every bench_ schema is ours.
func (b *bench) dropLeftovers(ctx context.Context) error {
	rows, err := b.pool.Query(ctx, `SELECT nspname FROM pg_namespace WHERE nspname LIKE 'bench\_%'`)
	if err != nil {
		return err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, n := range names {
		if _, err := b.pool.Exec(ctx, `DROP SCHEMA `+pgx.Identifier{n}.Sanitize()+` CASCADE`); err != nil {
			return fmt.Errorf("drop leftover schema %s: %w", n, err)
		}
	}
	return nil
}

// noiseMonitor samples, once a second, whether other databases on the
// server are running queries: on a small machine a test suite running next
// to the benchmark changes the figures by a factor of two, and the reader of
// the table should know.
type noiseMonitor struct {
	samples, busy atomic.Int64
	stop          context.CancelFunc
	done          chan struct{}
}

func (b *bench) monitorNoise(ctx context.Context) *noiseMonitor {
	ctx, cancel := context.WithCancel(ctx)
	m := &noiseMonitor{stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			var n int
			err := b.pool.QueryRow(ctx, `
				SELECT count(*) FROM pg_stat_activity
				 WHERE backend_type = 'client backend' AND state = 'active'
				   AND datname IS DISTINCT FROM current_database()`).Scan(&n)
			if err != nil {
				continue
			}
			m.samples.Add(1)
			if n > 0 {
				m.busy.Add(1)
			}
		}
	}()
	return m
}

// report stops sampling and says what it saw, with the load average.
func (m *noiseMonitor) report(w io.Writer) {
	m.stop()
	<-m.done
	fmt.Fprintf(w, "load average at the end: %s\n", loadavg())
	if busy := m.busy.Load(); busy > 0 {
		fmt.Fprintf(w, "WARNING: other databases on this server ran queries in %d of %d one-second samples; the figures are noisy, rerun on a quiet machine\n",
			busy, m.samples.Load())
	}
}

// loadavg is the 1/5/15-minute load average on Linux, "n/a" elsewhere.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "n/a"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "n/a"
	}
	return strings.Join(f[:3], " ")
}

// holdSnapshot opens a REPEATABLE READ transaction on a connection of its
// own and takes its snapshot, as a transaction left open elsewhere does:
// nothing deleted after it can be removed until release.
func (b *bench) holdSnapshot(ctx context.Context) (release func(), err error) {
	holder, err := b.conn(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := holder.Exec(ctx, `BEGIN ISOLATION LEVEL REPEATABLE READ`); err == nil {
		_, err = holder.Exec(ctx, `SELECT 1`) // takes the snapshot
	}
	if err != nil {
		_ = holder.Close(context.Background())
		return nil, err
	}
	return func() { _ = holder.Close(context.Background()) }, nil
}
