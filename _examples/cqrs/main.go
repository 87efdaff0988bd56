// CQRS wires Watermill's command and event buses over pgoutbox, the way
// Watermill's CQRS documentation teaches: a command handler books a room
// and publishes RoomBooked; three event handlers (an invoice, a
// notification, a statistic) each receive every RoomBooked, because each
// subscribes with its own consumer group (the handler name).
//
//	POSTGRES_DSN=postgres://... go run ./_examples/cqrs
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// BookRoom is the command.
type BookRoom struct {
	Room  string `json:"room"`
	Guest string `json:"guest"`
}

// RoomBooked is the event.
type RoomBooked struct {
	Room  string `json:"room"`
	Guest string `json:"guest"`
}

func main() {
	if err := run(); err != nil {
		log.Fatalf("cqrs example failed: %v", err)
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
	tables := schema.Config{Schema: "pgoutbox_cqrs_example", Table: "outbox"}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{tables.Schema}.Sanitize()+` CASCADE`) //nolint:errcheck

	logger := watermill.NopLogger{}
	// Buses publish through the pool: each Publish commits on its own.
	// (Inside your own transaction, bind a publisher to it instead.)
	publisher, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	// One subscriber per handler, its consumer group the handler name:
	// every handler gets every message of its topic.
	subscriberFor := func(handlerName string) (message.Subscriber, error) {
		return pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
			Tables:          tables,
			ConsumerGroup:   handlerName,
			MinPollInterval: 20 * time.Millisecond,
			MaxPollInterval: time.Second,
		}, logger)
	}
	marshaler := cqrs.JSONMarshaler{}
	topic := func(name string) string { return "hotel." + name }

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	commandBus, err := cqrs.NewCommandBusWithConfig(publisher, cqrs.CommandBusConfig{
		GeneratePublishTopic: func(p cqrs.CommandBusGeneratePublishTopicParams) (string, error) { return topic(p.CommandName), nil },
		Marshaler:            marshaler,
	})
	if err != nil {
		return err
	}
	eventBus, err := cqrs.NewEventBusWithConfig(publisher, cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return topic(p.EventName), nil },
		Marshaler:            marshaler,
	})
	if err != nil {
		return err
	}
	commands, err := cqrs.NewCommandProcessorWithConfig(router, cqrs.CommandProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
			return topic(p.CommandName), nil
		},
		SubscriberConstructor: func(p cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return subscriberFor(p.HandlerName)
		},
		Marshaler: marshaler,
	})
	if err != nil {
		return err
	}
	events, err := cqrs.NewEventProcessorWithConfig(router, cqrs.EventProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) {
			return topic(p.EventName), nil
		},
		SubscriberConstructor: func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return subscriberFor(p.HandlerName)
		},
		Marshaler: marshaler,
	})
	if err != nil {
		return err
	}

	if err := commands.AddHandlers(cqrs.NewCommandHandler("book_room", func(ctx context.Context, c *BookRoom) error {
		return eventBus.Publish(ctx, &RoomBooked{Room: c.Room, Guest: c.Guest})
	})); err != nil {
		return err
	}
	const bookings = 3
	var mu sync.Mutex
	seen := map[string]int{}
	allSeen := make(chan struct{})
	for _, name := range []string{"invoice", "notification", "statistics"} {
		err := events.AddHandlers(cqrs.NewEventHandler(name, func(ctx context.Context, e *RoomBooked) error {
			mu.Lock()
			defer mu.Unlock()
			seen[name]++
			fmt.Printf("%-12s got RoomBooked room=%s guest=%s\n", name, e.Room, e.Guest)
			if seen["invoice"] == bookings && seen["notification"] == bookings && seen["statistics"] == bookings {
				close(allSeen)
			}
			return nil
		}))
		if err != nil {
			return err
		}
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _ = router.Run(runCtx) }()
	<-router.Running() // every subscriber subscribed: every group is bound

	for i := range bookings {
		if err := commandBus.Send(ctx, &BookRoom{Room: fmt.Sprint(101 + i), Guest: "guest " + fmt.Sprint(i)}); err != nil {
			return err
		}
	}
	select {
	case <-allSeen:
		fmt.Printf("each of the 3 event handlers saw all %d events\n", bookings)
	case <-time.After(30 * time.Second):
		mu.Lock()
		defer mu.Unlock()
		return fmt.Errorf("timed out: handlers saw %v of %d events each", seen, bookings)
	}
	return router.Close()
}
