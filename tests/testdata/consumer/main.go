// Command consumer is the consumer process of the fault tests
// (tests/fault_test.go). It subscribes to one topic of a pgoutbox outbox
// through a Watermill router, records every message it handles as a row
// (uuid, worker) in <schema>.handled, and runs until SIGTERM or SIGINT. The
// tests SIGKILL it to simulate a crash.
//
// Settings, all required:
//
//	CONSUMER_POSTGRES_DSN   DSN of the test database
//	CONSUMER_SCHEMA         schema holding outbox, outbox_dlq and handled
//	CONSUMER_TOPIC          topic to consume
//	CONSUMER_WORKER         worker name stored in handled.worker
//	CONSUMER_MAX_IN_FLIGHT  SubscriberConfig.MaxInFlight
//
// Optional: CONSUMER_LEASE, SubscriberConfig.Lease as a Go duration
// (default 2s); CONSUMER_CLAIM_MODE, SubscriberConfig.ClaimMode (auto,
// lease or held; default auto); CONSUMER_HANDLE_TIME, how long each
// handling takes after its row is recorded, as a Go duration (default 0);
// CONSUMER_MAX_DELIVERIES, SubscriberConfig.MaxDeliveries (default 0);
// CONSUMER_POISON, a payload whose handling exits the process (status 3)
// before anything is recorded, as a handler that crashes it would;
// CONSUMER_FAIL, a payload whose handling is recorded and then fails (the
// handler returns an error); CONSUMER_RETRY_DELAY, the delay of a
// ConstantBackoff retry policy that never gives up, as a Go duration
// (default: the subscriber's default policy).
//
// It prints "consumer running" on stdout once the router runs.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
)

// ReadyLine is printed on stdout once the router is running.
const ReadyLine = "consumer running"

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

type settings struct {
	dsn, schema, topic, worker string
	maxInFlight, maxDeliveries int
	poison, fail               string
	lease, handleTime          time.Duration
	retryPolicy                pgoutbox.RetryPolicy
	claimMode                  pgoutbox.ClaimMode
}

func readSettings() (settings, error) {
	var s settings
	var missing []error
	get := func(name string) string {
		v := os.Getenv(name)
		if v == "" {
			missing = append(missing, fmt.Errorf("%s is not set", name))
		}
		return v
	}
	s.dsn = get("CONSUMER_POSTGRES_DSN")
	s.schema = get("CONSUMER_SCHEMA")
	s.topic = get("CONSUMER_TOPIC")
	s.worker = get("CONSUMER_WORKER")
	inFlight := get("CONSUMER_MAX_IN_FLIGHT")
	if err := errors.Join(missing...); err != nil {
		return s, err
	}
	n, err := strconv.Atoi(inFlight)
	if err != nil || n < 1 {
		return s, fmt.Errorf("CONSUMER_MAX_IN_FLIGHT is %q; it must be a positive integer", inFlight)
	}
	s.maxInFlight = n
	s.lease = 2 * time.Second
	if v := os.Getenv("CONSUMER_LEASE"); v != "" {
		if s.lease, err = time.ParseDuration(v); err != nil {
			return s, fmt.Errorf("CONSUMER_LEASE is %q; it must be a Go duration such as 30s", v)
		}
	}
	if v := os.Getenv("CONSUMER_HANDLE_TIME"); v != "" {
		if s.handleTime, err = time.ParseDuration(v); err != nil || s.handleTime < 0 {
			return s, fmt.Errorf("CONSUMER_HANDLE_TIME is %q; it must be a Go duration such as 2ms", v)
		}
	}
	if v := os.Getenv("CONSUMER_MAX_DELIVERIES"); v != "" {
		if s.maxDeliveries, err = strconv.Atoi(v); err != nil || s.maxDeliveries < 0 {
			return s, fmt.Errorf("CONSUMER_MAX_DELIVERIES is %q; it must be a count", v)
		}
	}
	s.poison = os.Getenv("CONSUMER_POISON")
	s.fail = os.Getenv("CONSUMER_FAIL")
	if v := os.Getenv("CONSUMER_RETRY_DELAY"); v != "" {
		delay, err := time.ParseDuration(v)
		if err != nil || delay < 0 {
			return s, fmt.Errorf("CONSUMER_RETRY_DELAY is %q; it must be a Go duration such as 1s", v)
		}
		s.retryPolicy = pgoutbox.ConstantBackoff{Delay: delay, MaxAttempts: pgoutbox.RetryForever}
	}
	if s.claimMode, err = pgoutbox.ParseClaimMode(os.Getenv("CONSUMER_CLAIM_MODE")); err != nil {
		return s, fmt.Errorf("CONSUMER_CLAIM_MODE: %w", err)
	}
	return s, nil
}

func run() error {
	s, err := readSettings()
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()

	poolCfg, err := pgxpool.ParseConfig(s.dsn)
	if err != nil {
		return fmt.Errorf("parse DSN: %w", err)
	}
	// Handlers, claims and completions each need a connection at times.
	poolCfg.MaxConns = int32(s.maxInFlight + 4)
	// The test names the process's connections (PGAPPNAME) to find them
	// in pg_stat_activity; otherwise they say what they are.
	if poolCfg.ConnConfig.RuntimeParams["application_name"] == "" {
		poolCfg.ConnConfig.RuntimeParams["application_name"] = "pgoutbox-consumer-" + s.worker
	}
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return fmt.Errorf("open pool: %w", err)
	}
	defer pool.Close()

	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
		Tables:          schema.Config{Schema: s.schema, Table: "outbox", DeadLetterTable: "outbox_dlq"},
		MaxInFlight:     s.maxInFlight,
		Lease:           s.lease,
		MinPollInterval: 20 * time.Millisecond,
		MaxPollInterval: time.Second,
		WorkerID:        s.worker,
		ClaimMode:       s.claimMode,
		MaxDeliveries:   s.maxDeliveries,
		RetryPolicy:     s.retryPolicy,
	}, logger)
	if err != nil {
		return err
	}
	defer sub.Close()

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	insert := `INSERT INTO ` + pgx.Identifier{s.schema, "handled"}.Sanitize() + ` (uuid, worker) VALUES ($1, $2)`
	router.AddMiddleware(pgoutbox.ErrorRecorder) // a failed handling's error is written with its nack
	router.AddConsumerHandler("consumer", s.topic, sub, func(m *message.Message) error {
		if s.poison != "" && string(m.Payload) == s.poison {
			os.Exit(3)
		}
		if _, err := pool.Exec(m.Context(), insert, m.UUID, s.worker); err != nil {
			return err
		}
		if s.fail != "" && string(m.Payload) == s.fail {
			return errors.New("the handler of " + s.fail + " fails")
		}
		if s.handleTime > 0 {
			time.Sleep(s.handleTime)
		}
		return nil
	})
	go func() {
		select {
		case <-router.Running():
			fmt.Println(ReadyLine)
		case <-ctx.Done():
		}
	}()
	// Run returns once SIGTERM or SIGINT cancelled ctx and the subscription
	// drained: in-flight messages were acked or nacked and their verdicts
	// written.
	if err := router.Run(ctx); err != nil {
		return err
	}
	return sub.Close()
}
