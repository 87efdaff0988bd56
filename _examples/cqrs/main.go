// CQRS wires Watermill's command and event buses over pgoutbox, the way
// Watermill's CQRS documentation teaches: a command handler books a room
// and publishes RoomBooked; three event handlers (an invoice, a
// notification, a statistic) each receive every RoomBooked, because each
// subscribes with its own consumer group (the handler name).
//
// A deploy step binds every handler's group ahead of traffic
// (cqrsbind.Commands and cqrsbind.Events, from the processors' own
// configuration), so the commands sent below, before the router first
// runs, and the events they cause are kept for every handler.
//
// With tx.Middleware on the router, every handler runs in a transaction of
// its own: the command handler writes the booking row in it
// (tx.PgxTxFromContext), and the event bus, built on a context publisher,
// publishes RoomBooked in it too. The booking, its event and the
// command's completion commit together, or not at all.
//
//	POSTGRES_DSN=postgres://... go run ./_examples/cqrs
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/cqrsbind"
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
	sch := pgx.Identifier{tables.Schema}.Sanitize()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+sch+` CASCADE`); err != nil {
		return err
	}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+sch+` CASCADE`) //nolint:errcheck
	if _, err := pool.Exec(ctx, `CREATE TABLE `+sch+`.bookings (room text PRIMARY KEY, guest text NOT NULL)`); err != nil {
		return err
	}

	logger := watermill.NopLogger{}
	// The buses are built once, on a publisher that follows the context:
	// in a handler (behind tx.Middleware) it publishes in the handler's
	// transaction; elsewhere, as commandBus.Send below, through the pool,
	// each Publish committing on its own.
	publisher, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	txMiddleware, err := tx.Middleware(tx.FromPgxPool(pool), tx.MiddlewareConfig{Publisher: publisher})
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

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 40 * time.Second}, logger)
	if err != nil {
		return err
	}
	// Each handler, command or event, gets a transaction of its own. The
	// middleware outside it sees each transaction commit (a nil error):
	// the example waits for those before closing the router, so that it
	// has something to print. (Closing would not cut a handler short: the
	// subscriber lets in-flight handlers finish within DrainTimeout.)
	committed := make(chan string, 64)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			produced, err := h(msg)
			if err == nil {
				committed <- message.HandlerNameFromCtx(msg.Context())
			}
			return produced, err
		}
	}, txMiddleware)
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
	commandsConfig := cqrs.CommandProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
			return topic(p.CommandName), nil
		},
		SubscriberConstructor: func(p cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return subscriberFor(p.HandlerName)
		},
		Marshaler: marshaler,
	}
	eventsConfig := cqrs.EventProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) {
			return topic(p.EventName), nil
		},
		SubscriberConstructor: func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return subscriberFor(p.HandlerName)
		},
		Marshaler: marshaler,
	}

	commandHandlers := []cqrs.CommandHandler{cqrs.NewCommandHandler("book_room", func(ctx context.Context, c *BookRoom) error {
		pgTx, ok := tx.PgxTxFromContext(ctx)
		if !ok {
			return errors.New("no transaction in the command's context: is tx.Middleware on the router?")
		}
		if _, err := pgTx.Exec(ctx, `INSERT INTO `+sch+`.bookings (room, guest) VALUES ($1, $2)`, c.Room, c.Guest); err != nil {
			return err
		}
		// ctx carries the transaction: the event commits with the booking.
		return eventBus.Publish(ctx, &RoomBooked{Room: c.Room, Guest: c.Guest})
	})}
	const bookings = 3
	handlers := []string{"book_room", "invoice", "notification", "statistics"}
	var eventHandlers []cqrs.EventHandler
	for _, name := range handlers[1:] {
		eventHandlers = append(eventHandlers, cqrs.NewEventHandler(name, func(ctx context.Context, e *RoomBooked) error {
			fmt.Printf("%-12s got RoomBooked room=%s guest=%s\n", name, e.Room, e.Guest)
			return nil
		}))
	}

	// The deploy step: bind every handler's group to its topic before any
	// traffic (it needs no router, only the processors' configuration).
	if err := cqrsbind.Commands(ctx, commandsConfig, commandHandlers); err != nil {
		return err
	}
	if err := cqrsbind.Events(ctx, eventsConfig, eventHandlers); err != nil {
		return err
	}
	// The API sends its commands before the worker ever ran: they wait
	// for the book_room group, and the events for each event handler.
	for i := range bookings {
		if err := commandBus.Send(ctx, &BookRoom{Room: fmt.Sprint(101 + i), Guest: "guest " + fmt.Sprint(i)}); err != nil {
			return err
		}
	}

	commands, err := cqrs.NewCommandProcessorWithConfig(router, commandsConfig)
	if err != nil {
		return err
	}
	events, err := cqrs.NewEventProcessorWithConfig(router, eventsConfig)
	if err != nil {
		return err
	}
	if err := commands.AddHandlers(commandHandlers...); err != nil {
		return err
	}
	if err := events.AddHandlers(eventHandlers...); err != nil {
		return err
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _ = router.Run(runCtx) }()
	// Every handler commits once per booking: the command handler and
	// each event handler.
	commits := map[string]int{}
	timeout := time.After(30 * time.Second)
	for range bookings * len(handlers) {
		select {
		case name := <-committed:
			commits[name]++
		case <-timeout:
			return fmt.Errorf("timed out: committed %v, want %d for each of %v", commits, bookings, handlers)
		}
	}
	for _, name := range handlers {
		if commits[name] != bookings {
			return fmt.Errorf("committed %v, want %d for each of %v", commits, bookings, handlers)
		}
	}
	fmt.Printf("book_room committed %d bookings; each of the 3 event handlers committed all %d events\n", bookings, bookings)
	if err := router.Close(); err != nil {
		return err
	}
	var booked, left int
	err = pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+sch+`.bookings), (SELECT count(*) FROM `+
		pgx.Identifier{tables.Schema, tables.Table}.Sanitize()+`)`).Scan(&booked, &left)
	if err != nil {
		return err
	}
	if booked != bookings || left != 0 {
		return fmt.Errorf("%d bookings stored (want %d), %d messages left in the outbox (want 0)", booked, bookings, left)
	}
	fmt.Printf("%d booking rows, each committed with its RoomBooked event; the outbox is empty\n", booked)
	return nil
}
