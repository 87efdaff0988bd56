// Package cqrsbind binds the consumer groups of Watermill CQRS handlers to
// their topics ahead of traffic, from a deploy step or at start, without
// listing topic and group pairs by hand.
//
// A CQRS processor learns a handler's topic from GenerateSubscribeTopic and
// its subscriber (whose ConsumerGroup is, by convention, the handler name)
// from SubscriberConstructor. Events, EventGroups and Commands call both, with the same
// parameters the processor passes, for every handler, and bind each
// subscriber's group to its topic. The groups of one topic are bound in one
// call: if the topic had no binding, each of them gets the messages it
// received so far (see pgoutbox.BindGroups). The subscribers are not
// closed: one that never subscribed holds nothing (no goroutine, no
// connection), and SubscriberConstructor may return a subscriber the
// application shares between handlers of different topics, as Watermill's
// CQRS examples do. Two handlers of one topic with one consumer group are
// refused: they would compete for its messages, each getting some.
//
//	eventsConfig := cqrs.EventProcessorConfig{GenerateSubscribeTopic: ..., SubscriberConstructor: ..., Marshaler: ...}
//	handlers := []cqrs.EventHandler{invoice, notification, statistics}
//	if err := cqrsbind.Events(ctx, eventsConfig, handlers); err != nil { ... }
//	events, err := cqrs.NewEventProcessorWithConfig(router, eventsConfig)
//	err = events.AddHandlers(handlers...)
//
// SubscriberConstructor must return a *pgoutbox.Subscriber (not wrapped by
// a decorator), so that its group and outbox can be read.
package cqrsbind

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// Events binds the consumer group of every event handler of handlers to
// its topic, as config's processor would subscribe it. config needs
// GenerateSubscribeTopic, SubscriberConstructor and Marshaler, as
// cqrs.NewEventProcessorWithConfig does.
//
// Bind the handlers of every processor of the service in one Bind call
// instead when an EventGroupProcessor subscribes the same events.
func Events(ctx context.Context, config cqrs.EventProcessorConfig, handlers []cqrs.EventHandler) error {
	return Bind(ctx, Processors{Events: &config, EventHandlers: handlers})
}

func (b *binder) events(config cqrs.EventProcessorConfig, handlers []cqrs.EventHandler) error {
	if config.GenerateSubscribeTopic == nil || config.SubscriberConstructor == nil || config.Marshaler == nil {
		return errors.New("pgoutbox/cqrsbind: EventProcessorConfig needs GenerateSubscribeTopic, SubscriberConstructor and Marshaler; pass the config of the processor")
	}
	for _, h := range handlers {
		eventName := config.Marshaler.Name(h.NewEvent())
		topic, err := config.GenerateSubscribeTopic(cqrs.EventProcessorGenerateSubscribeTopicParams{EventName: eventName, EventHandler: h})
		if err != nil {
			return fmt.Errorf("pgoutbox/cqrsbind: topic of event handler %q: %w", h.HandlerName(), err)
		}
		sub, err := config.SubscriberConstructor(cqrs.EventProcessorSubscriberConstructorParams{
			EventName: eventName, HandlerName: h.HandlerName(), EventHandler: h})
		if err := b.add(topic, h.HandlerName(), sub, err); err != nil {
			return err
		}
	}
	return nil
}

// EventGroups binds the consumer group of every handler group of groups
// (keyed by group name, as cqrs.EventGroupProcessor.AddHandlersGroup takes
// them) to its topic, as config's processor would subscribe it. config
// needs GenerateSubscribeTopic and SubscriberConstructor, as
// cqrs.NewEventGroupProcessorWithConfig does.
//
// Bind the handlers of every processor of the service in one Bind call
// instead when an EventProcessor subscribes the same events: bound by a
// later call, these groups would get nothing published before it.
func EventGroups(ctx context.Context, config cqrs.EventGroupProcessorConfig, groups map[string][]cqrs.GroupEventHandler) error {
	return Bind(ctx, Processors{EventGroups: &config, Groups: groups})
}

func (b *binder) eventGroups(config cqrs.EventGroupProcessorConfig, groups map[string][]cqrs.GroupEventHandler) error {
	if config.GenerateSubscribeTopic == nil || config.SubscriberConstructor == nil {
		return errors.New("pgoutbox/cqrsbind: EventGroupProcessorConfig needs GenerateSubscribeTopic and SubscriberConstructor; pass the config of the processor")
	}
	for _, name := range slices.Sorted(maps.Keys(groups)) {
		topic, err := config.GenerateSubscribeTopic(cqrs.EventGroupProcessorGenerateSubscribeTopicParams{
			EventGroupName: name, EventGroupHandlers: groups[name]})
		if err != nil {
			return fmt.Errorf("pgoutbox/cqrsbind: topic of event handler group %q: %w", name, err)
		}
		sub, err := config.SubscriberConstructor(cqrs.EventGroupProcessorSubscriberConstructorParams{
			EventGroupName: name, EventGroupHandlers: groups[name]})
		if err := b.add(topic, name, sub, err); err != nil {
			return err
		}
	}
	return nil
}

// Commands binds the consumer group of every command handler of handlers
// to its topic, as config's processor would subscribe it. config needs
// GenerateSubscribeTopic, SubscriberConstructor and Marshaler, as
// cqrs.NewCommandProcessorWithConfig does.
func Commands(ctx context.Context, config cqrs.CommandProcessorConfig, handlers []cqrs.CommandHandler) error {
	return Bind(ctx, Processors{Commands: &config, CommandHandlers: handlers})
}

func (b *binder) commands(config cqrs.CommandProcessorConfig, handlers []cqrs.CommandHandler) error {
	if config.GenerateSubscribeTopic == nil || config.SubscriberConstructor == nil || config.Marshaler == nil {
		return errors.New("pgoutbox/cqrsbind: CommandProcessorConfig needs GenerateSubscribeTopic, SubscriberConstructor and Marshaler; pass the config of the processor")
	}
	for _, h := range handlers {
		commandName := config.Marshaler.Name(h.NewCommand())
		topic, err := config.GenerateSubscribeTopic(cqrs.CommandProcessorGenerateSubscribeTopicParams{CommandName: commandName, CommandHandler: h})
		if err != nil {
			return fmt.Errorf("pgoutbox/cqrsbind: topic of command handler %q: %w", h.HandlerName(), err)
		}
		sub, err := config.SubscriberConstructor(cqrs.CommandProcessorSubscriberConstructorParams{
			CommandName: commandName, HandlerName: h.HandlerName(), Handler: h})
		if err := b.add(topic, h.HandlerName(), sub, err); err != nil {
			return err
		}
	}
	return nil
}

// Processors are a service's CQRS processors as Bind binds them: the config
// each processor is made with and the handlers it is given. Leave out the
// kinds the service does not have (a nil config).
type Processors struct {
	// Events and EventHandlers: cqrs.NewEventProcessorWithConfig's config
	// and what its AddHandlers gets.
	Events        *cqrs.EventProcessorConfig
	EventHandlers []cqrs.EventHandler
	// EventGroups and Groups: cqrs.NewEventGroupProcessorWithConfig's config
	// and its handler groups by name, as AddHandlersGroup takes them.
	EventGroups *cqrs.EventGroupProcessorConfig
	Groups      map[string][]cqrs.GroupEventHandler
	// Commands and CommandHandlers: cqrs.NewCommandProcessorWithConfig's
	// config and what its AddHandlers gets.
	Commands        *cqrs.CommandProcessorConfig
	CommandHandlers []cqrs.CommandHandler
}

// Bind binds the consumer group of every handler of p to its topic, all the
// groups of one topic in one call whichever processor subscribes them. An
// EventProcessor's handlers and an EventGroupProcessor's groups of the same
// events are then that topic's first groups together, and each gets what
// was published before any of them was bound; bound by two calls (Events,
// then EventGroups), the second call's groups would bind later and get none
// of it.
func Bind(ctx context.Context, p Processors) error {
	for _, missing := range []struct {
		config   bool
		handlers int
		name     string
	}{{p.Events == nil, len(p.EventHandlers), "EventHandlers without Events"}, {p.EventGroups == nil, len(p.Groups), "Groups without EventGroups"},
		{p.Commands == nil, len(p.CommandHandlers), "CommandHandlers without Commands"}} {
		if missing.config && missing.handlers > 0 {
			return fmt.Errorf("pgoutbox/cqrsbind: Processors has %s: pass the config the processor is made with", missing.name)
		}
	}
	b := newBinder()
	if p.Events != nil {
		if err := b.events(*p.Events, p.EventHandlers); err != nil {
			return err
		}
	}
	if p.EventGroups != nil {
		if err := b.eventGroups(*p.EventGroups, p.Groups); err != nil {
			return err
		}
	}
	if p.Commands != nil {
		if err := b.commands(*p.Commands, p.CommandHandlers); err != nil {
			return err
		}
	}
	return b.bind(ctx)
}

// binder collects the subscribers per topic, in the order first seen.
type binder struct {
	topics []string
	subs   map[string][]*pgoutbox.Subscriber
	owner  map[[4]string]string // (schema, table, topic, group) -> the handler that subscribes it
}

func newBinder() *binder {
	return &binder{subs: map[string][]*pgoutbox.Subscriber{}, owner: map[[4]string]string{}}
}

func (b *binder) add(topic, handler string, sub message.Subscriber, err error) error {
	if err != nil {
		return fmt.Errorf("pgoutbox/cqrsbind: subscriber of handler %q: %w", handler, err)
	}
	ps, ok := sub.(*pgoutbox.Subscriber)
	if !ok {
		return fmt.Errorf("pgoutbox/cqrsbind: the subscriber of handler %q is a %T, not a *pgoutbox.Subscriber; return the pgoutbox subscriber itself from SubscriberConstructor", handler, sub)
	}
	// Two handlers of one topic in one group compete for its messages:
	// each gets some, and a processor acks and drops one meant for
	// another handler. A shared subscriber serves handlers of different
	// topics only.
	// Of one outbox: handlers of different outboxes read different tables.
	t := ps.Tables()
	key := [4]string{t.Schema, t.Table, topic, ps.ConsumerGroup()}
	if other, ok := b.owner[key]; ok && other != handler {
		return fmt.Errorf("pgoutbox/cqrsbind: handlers %q and %q subscribe topic %q in one consumer group %q, so each message would reach one of them only; "+
			"give each handler a subscriber of its own group (SubscriberConfig.ConsumerGroup: the handler name)", other, handler, topic, ps.ConsumerGroup())
	}
	b.owner[key] = handler
	if _, seen := b.subs[topic]; !seen {
		b.topics = append(b.topics, topic)
	}
	b.subs[topic] = append(b.subs[topic], ps)
	return nil
}

func (b *binder) bind(ctx context.Context) error {
	for _, topic := range b.topics {
		if err := pgoutbox.BindSubscribers(ctx, topic, b.subs[topic]...); err != nil {
			return fmt.Errorf("pgoutbox/cqrsbind: %w", err)
		}
	}
	return nil
}
