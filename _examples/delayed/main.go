// Delayed shows timers on the outbox: a message delayed with
// pgoutbox.DeliverAfter, one delayed with Watermill's components/delay
// metadata, a second publish under the same dedup key (skipped), and a
// reminder scheduled with pgoutbox.DeliverAt and a dedup key, then
// cancelled with CancelScheduled before it was due. A subscription
// delivers in due-time order, so the message due after the cancelled one
// arriving alone proves the cancelled one is gone.
//
//	POSTGRES_DSN=postgres://... go run ./_examples/delayed
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const topic = "orders.reminders"

// timer is one message of the example and the earliest time it may arrive.
type timer struct {
	name     string
	notUntil time.Time
}

func main() {
	if err := run(); err != nil {
		log.Fatalf("delayed example failed: %v", err)
	}
}

func run() error {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	tables := schema.Config{Schema: "pgoutbox_delayed_example", Table: "outbox"}
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{tables.Schema}.Sanitize()+` CASCADE`); err != nil {
		return err
	}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{tables.Schema}.Sanitize()+` CASCADE`) //nolint:errcheck

	logger := watermill.NopLogger{}
	// Each Publish commits on its own here; in your transaction, bind the
	// publisher to it and the timer exists only if the transaction commits.
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	// The default MaxInFlight (1) delivers in due-time order.
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 40 * time.Second}, logger)
	if err != nil {
		return err
	}
	start := time.Now()
	type arrival struct {
		name string
		at   time.Time
	}
	arrivals := make(chan arrival, 10)
	router.AddConsumerHandler("send_reminder", topic, sub, func(msg *message.Message) error {
		now := time.Now()
		fmt.Printf("%6s  received %q\n", now.Sub(start).Round(time.Millisecond), msg.Payload)
		arrivals <- arrival{string(msg.Payload), now}
		return nil
	})
	routerErr := make(chan error, 1)
	go func() { routerErr <- router.Run(ctx) }()
	<-router.Running()

	newMsg := func(name string) *message.Message { return message.NewMessage(watermill.NewUUID(), []byte(name)) }
	// Every deadline is measured from before its Publish: the database
	// clock starts the delay later than that, never earlier.
	var want []timer

	now := newMsg("order 42 placed")
	want = append(want, timer{"order 42 placed", time.Now()})
	if err := pub.Publish(topic, now); err != nil {
		return err
	}

	// Watermill's own delay metadata works as on any Pub/Sub that supports it.
	viaWatermill := newMsg("order 42: ask for a review")
	delay.Message(viaWatermill, delay.For(200*time.Millisecond))
	want = append(want, timer{"order 42: ask for a review", time.Now().Add(200 * time.Millisecond)})
	if err := pub.Publish(topic, viaWatermill); err != nil {
		return err
	}

	// Scheduled at a point in time, with a key to cancel it by.
	cancelled := newMsg("order 43: payment reminder")
	pgoutbox.DeliverAt(cancelled, time.Now().Add(300*time.Millisecond))
	pgoutbox.WithDedupKey(cancelled, "remind-order-43")
	if err := pub.Publish(topic, cancelled); err != nil {
		return err
	}

	// Delayed by a duration, on the database clock. The second publish
	// under the same key is skipped: one reminder per order.
	reminder := newMsg("order 42: payment reminder")
	pgoutbox.DeliverAfter(reminder, 400*time.Millisecond)
	pgoutbox.WithDedupKey(reminder, "remind-order-42")
	want = append(want, timer{"order 42: payment reminder", time.Now().Add(400 * time.Millisecond)})
	if err := pub.Publish(topic, reminder); err != nil {
		return err
	}
	again := newMsg("order 42: payment reminder, again")
	pgoutbox.DeliverAfter(again, 400*time.Millisecond)
	pgoutbox.WithDedupKey(again, "remind-order-42")
	res, err := pub.PublishWithResult(topic, again)
	if err != nil {
		return err
	}
	if len(res.Skipped()) != 1 {
		return fmt.Errorf("the second publish under key remind-order-42 was stored, want it skipped")
	}
	fmt.Printf("%6s  published 4 messages; a 5th under key remind-order-42 was skipped\n", time.Since(start).Round(time.Millisecond))

	// Order 43 was paid: cancel its reminder before it is due.
	ok, err := pub.CancelScheduled(ctx, topic, "remind-order-43")
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("CancelScheduled found no message under key remind-order-43")
	}
	fmt.Printf("%6s  cancelled the reminder of order 43 (key remind-order-43)\n", time.Since(start).Round(time.Millisecond))

	// Wait for the three messages; arriving in due-time order, the last
	// (due at 400 ms) comes after the cancelled one's time (300 ms).
	timeout := time.After(10 * time.Second)
	for i, w := range want {
		var a arrival
		select {
		case a = <-arrivals:
		case err := <-routerErr:
			return fmt.Errorf("router stopped: %v", err)
		case <-timeout:
			return fmt.Errorf("timed out waiting for %q", w.name)
		}
		if a.name != w.name {
			return fmt.Errorf("arrival %d is %q, want %q", i+1, a.name, w.name)
		}
		if a.at.Before(w.notUntil) {
			return fmt.Errorf("%q arrived %s before its time", a.name, w.notUntil.Sub(a.at))
		}
	}
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-routerErr; err != nil {
		return err
	}
	if len(arrivals) > 0 {
		return fmt.Errorf("unexpected message %q", (<-arrivals).name)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{tables.Schema, tables.Table}.Sanitize()).Scan(&left); err != nil {
		return err
	}
	if left != 0 {
		return fmt.Errorf("%d message(s) left in the outbox, want 0", left)
	}
	fmt.Println("each message arrived no earlier than its time; the cancelled reminder never did")
	return nil
}
