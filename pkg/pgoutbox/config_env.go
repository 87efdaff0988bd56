package pgoutbox

import (
	"errors"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/envname"
)

// SubscriberConfigFromEnv reads a SubscriberConfig from environment
// variables named prefix + "_" + NAME (prefix "PGOUTBOX" reads
// PGOUTBOX_LEASE; an empty prefix reads LEASE). It is opt-in: nothing else
// in pgoutbox reads the environment. An unset or empty variable leaves the
// field at its default. The variables:
//
//	SCHEMA, TABLE, DLQ_TABLE      Tables.Schema, Table, DeadLetterTable (identifiers)
//	NO_DLQ                        Tables.NoDeadLetterTable (bool: true, false, 1, 0)
//	ARRIVALS, ROTATING            Tables.Arrivals, Tables.Rotating (bool)
//	ROTATION_WINDOW               RotationWindow (Go duration)
//	CONSUMER_GROUP                ConsumerGroup
//	START_FROM                    StartFrom (new or backlog)
//	MAX_IN_FLIGHT                 MaxInFlight (integer)
//	LEASE                         Lease (Go duration: 30s, 1m30s)
//	MIN_POLL_INTERVAL             MinPollInterval (Go duration)
//	MAX_POLL_INTERVAL             MaxPollInterval (Go duration)
//	STATEMENT_TIMEOUT             StatementTimeout (Go duration)
//	DRAIN_TIMEOUT                 DrainTimeout (Go duration, or -1)
//	ACK_DEADLINE                  AckDeadline (Go duration, or -1)
//	MAX_DELIVERIES                MaxDeliveries (integer, 0 for no limit)
//	SYNCHRONOUS_COMMIT            SynchronousCommit (bool)
//	CLAIM_MODE                    ClaimMode (auto, lease or held)
//	WORKER_ID                     WorkerID
//	LISTEN_DSN                    ListenDSN
//	AUTO_INITIALIZE_SCHEMA        AutoInitializeSchema (bool)
//	RETRY_MAX_ATTEMPTS            } any of these sets RetryPolicy to an
//	RETRY_INITIAL_INTERVAL        } ExponentialBackoff with these fields
//	RETRY_MAX_INTERVAL            } (integer, -1 for forever; durations;
//	RETRY_MULTIPLIER              } a number of 1 or more; from 0 to 1,
//	RETRY_JITTER                  } or -1 for none); unset ones default
//
// RetryPolicy (beyond the above), Observer and other func or interface
// fields are left for code to set. A present but invalid value is an
// error naming the variable and the format it expects, and so is a
// variable of the prefix that is one of these (or of PublisherConfigFromEnv's)
// spelt with other underscores or case, such as PGOUTBOX_MAXINFLIGHT; all
// of them are reported at once (errors.Join, matching ErrInvalidConfig).
// The prefix's other variables are left alone. When every
// value parses, the result is checked with Validate, whose error is
// returned.
func SubscriberConfigFromEnv(prefix string) (SubscriberConfig, error) {
	return subscriberConfigFromLookup(prefix, os.Environ(), os.LookupEnv)
}

// PublisherConfigFromEnv reads a PublisherConfig from environment
// variables named prefix + "_" + NAME, like SubscriberConfigFromEnv. An
// unset or empty variable leaves the field at its default. The variables:
//
//	SCHEMA, TABLE, DLQ_TABLE      Tables.Schema, Table, DeadLetterTable (identifiers)
//	NO_DLQ                        Tables.NoDeadLetterTable (bool)
//	ARRIVALS, ROTATING            Tables.Arrivals, Tables.Rotating (bool)
//	STATEMENT_TIMEOUT             StatementTimeout (Go duration: 10s)
//	NOTIFY_COOLDOWN               NotifyCooldown (Go duration, or -1)
//	MAX_PAYLOAD_BYTES             MaxPayloadBytes (integer, or -1 for no limit)
//
// Observer and GenerateOrderingKey are left for code to set. Invalid
// values and misspelt variables are reported together, as by
// SubscriberConfigFromEnv; then the result is checked with Validate.
func PublisherConfigFromEnv(prefix string) (PublisherConfig, error) {
	return publisherConfigFromLookup(prefix, os.Environ(), os.LookupEnv)
}

// envReader reads prefixed variables and collects the problems.
type envReader struct {
	prefix string
	lookup func(string) (string, bool)
	errs   []error
}

func newEnvReader(prefix string, lookup func(string) (string, bool)) *envReader {
	if prefix != "" && !strings.HasSuffix(prefix, "_") {
		prefix += "_"
	}
	return &envReader{prefix: prefix, lookup: lookup}
}

// get returns the variable's value and whether it is set and not empty.
func (r *envReader) get(name string) (string, string, bool) {
	key := r.prefix + name
	v, ok := r.lookup(key)
	v = strings.TrimSpace(v)
	return key, v, ok && v != ""
}

func (r *envReader) fail(key, value, format string) {
	r.errs = append(r.errs, errorf("%w: %s=%q is not valid; use %s", ErrInvalidConfig, key, value, format))
}

func (r *envReader) str(name string, dst *string) bool {
	_, v, ok := r.get(name)
	if ok {
		*dst = v
	}
	return ok
}

func (r *envReader) boolean(name string, dst *bool) {
	key, v, ok := r.get(name)
	if !ok {
		return
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		r.fail(key, v, "true or false (or 1, 0)")
		return
	}
	*dst = b
}

func (r *envReader) integer(name string, dst *int, format string) bool {
	key, v, ok := r.get(name)
	if !ok {
		return false
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		r.fail(key, v, format)
		return false
	}
	*dst = n
	return true
}

func (r *envReader) float(name string, dst *float64, format string) bool {
	key, v, ok := r.get(name)
	if !ok {
		return false
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		r.fail(key, v, format)
		return false
	}
	*dst = f
	return true
}

// duration reads a Go duration; minusOne also accepts "-1" (the special
// value of some fields), stored as -1.
func (r *envReader) duration(name string, dst *time.Duration, minusOne string) bool {
	key, v, ok := r.get(name)
	if !ok {
		return false
	}
	if minusOne != "" && v == "-1" {
		*dst = -1
		return true
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		format := "a positive Go duration such as 30s, 500ms or 1m30s"
		if minusOne != "" {
			format += ", or -1 " + minusOne
		}
		r.fail(key, v, format)
		return false
	}
	*dst = d
	return true
}

func (r *envReader) err() error { return errors.Join(r.errs...) }

// envNames are the variables SubscriberConfigFromEnv and
// PublisherConfigFromEnv read, without the prefix.
var envNames = []string{
	"SCHEMA", "TABLE", "DLQ_TABLE", "NO_DLQ", "ARRIVALS", "ROTATING", "ROTATION_WINDOW", "CONSUMER_GROUP",
	"START_FROM", "MAX_IN_FLIGHT", "LEASE", "MIN_POLL_INTERVAL", "MAX_POLL_INTERVAL", "STATEMENT_TIMEOUT",
	"DRAIN_TIMEOUT", "ACK_DEADLINE", "MAX_DELIVERIES", "SYNCHRONOUS_COMMIT", "CLAIM_MODE", "WORKER_ID",
	"LISTEN_DSN", "AUTO_INITIALIZE_SCHEMA", "RETRY_MAX_ATTEMPTS", "RETRY_INITIAL_INTERVAL", "RETRY_MAX_INTERVAL",
	"RETRY_MULTIPLIER", "RETRY_JITTER", "NOTIFY_COOLDOWN", "MAX_PAYLOAD_BYTES",
}

// misspelt reports a variable of the prefix that is one of envNames
// spelt with other underscores or case (PGOUTBOX_MAXINFLIGHT): read by
// nobody, it would leave its field at the default without a word. Other
// variables of the prefix are left alone: they may be the application's.
func (r *envReader) misspelt(environ []string) {
	for _, kv := range environ {
		key, _, _ := strings.Cut(kv, "=")
		if len(key) <= len(r.prefix) || !strings.EqualFold(key[:len(r.prefix)], r.prefix) {
			continue
		}
		for _, known := range envNames {
			if envname.Misspelt(key, r.prefix+known) {
				r.errs = append(r.errs, errorf("%w: %s is not read (a misspelling?); use %s%s", ErrInvalidConfig, key, r.prefix, known))
			}
		}
	}
}

// invalid is Validate's error for a configuration read from the
// variables: its problems name the fields, so it ends by naming the
// variable of each field it mentions.
func (r *envReader) invalid(err error) error {
	text := err.Error()
	var set []string
	for _, fv := range fieldVariables {
		if _, ok := r.lookup(r.prefix + fv[1]); ok && strings.Contains(text, fv[0]) {
			set = append(set, fv[0]+" is "+r.prefix+fv[1])
		}
	}
	if len(set) == 0 {
		return errorf("pgoutbox: the %s* variables: %w", r.prefix, err)
	}
	return errorf("pgoutbox: the %s* variables: %w (%s)", r.prefix, err, strings.Join(set, ", "))
}

// fieldVariables pairs the fields Validate names with their variables.
var fieldVariables = [][2]string{
	{"StatementTimeout", "STATEMENT_TIMEOUT"}, {"Lease", "LEASE"}, {"MinPollInterval", "MIN_POLL_INTERVAL"},
	{"MaxPollInterval", "MAX_POLL_INTERVAL"}, {"DrainTimeout", "DRAIN_TIMEOUT"}, {"AckDeadline", "ACK_DEADLINE"},
	{"MaxDeliveries", "MAX_DELIVERIES"}, {"RotationWindow", "ROTATION_WINDOW"}, {"WorkerID", "WORKER_ID"},
	{"ConsumerGroup", "CONSUMER_GROUP"}, {"StartFrom", "START_FROM"}, {"ListenDSN", "LISTEN_DSN"},
	{"ClaimMode", "CLAIM_MODE"}, {"NotifyCooldown", "NOTIFY_COOLDOWN"}, {"MaxPayloadBytes", "MAX_PAYLOAD_BYTES"},
}

func (r *envReader) tables(c *SubscriberConfig) {
	r.str("SCHEMA", &c.Tables.Schema)
	r.str("TABLE", &c.Tables.Table)
	r.str("DLQ_TABLE", &c.Tables.DeadLetterTable)
	r.boolean("NO_DLQ", &c.Tables.NoDeadLetterTable)
	// The layout must be told as in code: a subscriber without Arrivals
	// never looks at the arrivals table, so a service configured only
	// from the environment would leave its messages there.
	r.boolean("ARRIVALS", &c.Tables.Arrivals)
	r.boolean("ROTATING", &c.Tables.Rotating)
}

// retryVariables names the variable of each ExponentialBackoff field.
var retryVariables = map[string]string{
	"InitialInterval": "RETRY_INITIAL_INTERVAL",
	"MaxInterval":     "RETRY_MAX_INTERVAL",
	"Multiplier":      "RETRY_MULTIPLIER",
	"MaxAttempts":     "RETRY_MAX_ATTEMPTS",
	"Jitter":          "RETRY_JITTER",
}

func subscriberConfigFromLookup(prefix string, environ []string, lookup func(string) (string, bool)) (SubscriberConfig, error) {
	r := newEnvReader(prefix, lookup)
	r.misspelt(environ)
	var c SubscriberConfig
	r.tables(&c)
	r.str("CONSUMER_GROUP", &c.ConsumerGroup)
	var from string
	if r.str("START_FROM", &from) {
		c.StartFrom = StartFrom(from)
	}
	// 0 would be the field's "unset" (1): present in the environment it
	// is a mistake (meant as "no limit"?), not a default.
	if r.integer("MAX_IN_FLIGHT", &c.MaxInFlight, "a whole number, at least 1") && c.MaxInFlight < 1 {
		key, v, _ := r.get("MAX_IN_FLIGHT")
		r.fail(key, v, "a whole number, at least 1 (there is no unlimited: it bounds the messages in flight)")
	}
	r.duration("LEASE", &c.Lease, "")
	r.duration("ROTATION_WINDOW", &c.RotationWindow, "")
	r.duration("MIN_POLL_INTERVAL", &c.MinPollInterval, "")
	r.duration("MAX_POLL_INTERVAL", &c.MaxPollInterval, "")
	r.duration("STATEMENT_TIMEOUT", &c.StatementTimeout, "")
	r.duration("DRAIN_TIMEOUT", &c.DrainTimeout, "to release in-flight rows without waiting")
	r.duration("ACK_DEADLINE", &c.AckDeadline, "for no deadline")
	if r.integer("MAX_DELIVERIES", &c.MaxDeliveries, "a whole number, 0 for no limit") && c.MaxDeliveries < 0 {
		key, v, _ := r.get("MAX_DELIVERIES")
		r.fail(key, v, "a whole number, 0 for no limit")
	}
	r.boolean("SYNCHRONOUS_COMMIT", &c.SynchronousCommit)
	var mode string
	if r.str("CLAIM_MODE", &mode) {
		m, err := ParseClaimMode(mode)
		if err != nil {
			r.fail(r.prefix+"CLAIM_MODE", mode, "auto, lease or held")
		}
		c.ClaimMode = m
	}
	r.str("WORKER_ID", &c.WorkerID)
	r.str("LISTEN_DSN", &c.ListenDSN)
	r.boolean("AUTO_INITIALIZE_SCHEMA", &c.AutoInitializeSchema)

	var b ExponentialBackoff
	retry := r.integer("RETRY_MAX_ATTEMPTS", &b.MaxAttempts, "a whole number of deliveries, at least 1, or -1 to retry forever")
	retry = r.duration("RETRY_INITIAL_INTERVAL", &b.InitialInterval, "") || retry
	retry = r.duration("RETRY_MAX_INTERVAL", &b.MaxInterval, "") || retry
	retry = r.float("RETRY_MULTIPLIER", &b.Multiplier, "a number of 1 or more, such as 2 or 1.5") || retry
	retry = r.float("RETRY_JITTER", &b.Jitter, "a number from 0 to 1 (0.2 spreads delays by ±20%), or -1 for none") || retry
	if retry {
		// The checks of SubscriberConfig.Validate, reported per variable.
		for _, p := range b.problems() {
			key, v, _ := r.get(retryVariables[p.field])
			r.fail(key, v, strings.ReplaceAll(p.want, "NoJitter (-1)", "-1 for none"))
		}
		c.RetryPolicy = b
	}
	if err := r.err(); err != nil {
		return SubscriberConfig{}, err
	}
	if err := c.Validate(); err != nil {
		return SubscriberConfig{}, r.invalid(err)
	}
	return c, nil
}

func publisherConfigFromLookup(prefix string, environ []string, lookup func(string) (string, bool)) (PublisherConfig, error) {
	r := newEnvReader(prefix, lookup)
	r.misspelt(environ)
	var sc SubscriberConfig
	r.tables(&sc)
	c := PublisherConfig{Tables: sc.Tables}
	r.duration("STATEMENT_TIMEOUT", &c.StatementTimeout, "")
	r.duration("NOTIFY_COOLDOWN", &c.NotifyCooldown, "to notify in every Publish")
	if r.integer("MAX_PAYLOAD_BYTES", &c.MaxPayloadBytes, "a whole number of bytes, or -1 for no limit") && c.MaxPayloadBytes < NoPayloadLimit {
		key, v, _ := r.get("MAX_PAYLOAD_BYTES")
		r.fail(key, v, "a whole number of bytes, or -1 for no limit")
	}
	if err := r.err(); err != nil {
		return PublisherConfig{}, err
	}
	if err := c.Validate(); err != nil {
		return PublisherConfig{}, r.invalid(err)
	}
	return c, nil
}

// EnvConfig is what ConfigFromEnv reads: the configurations of a
// service's publisher and subscriber, which share the table names.
type EnvConfig struct {
	Publisher  PublisherConfig
	Subscriber SubscriberConfig
}

// ConfigFromEnv reads both configurations from the variables named prefix
// + "_" + NAME: SubscriberConfigFromEnv's and PublisherConfigFromEnv's
// (the table variables and STATEMENT_TIMEOUT apply to both). It reports
// the problems of both at once.
func ConfigFromEnv(prefix string) (EnvConfig, error) {
	sub, subErr := SubscriberConfigFromEnv(prefix)
	pub, pubErr := PublisherConfigFromEnv(prefix)
	if err := joinDistinct(subErr, pubErr); err != nil {
		return EnvConfig{}, err
	}
	return EnvConfig{Publisher: pub, Subscriber: sub}, nil
}

// joinDistinct joins a and b, leaving out the lines of b whose problem a
// states already: the variables both configurations read (the tables,
// STATEMENT_TIMEOUT) are reported once. errors.Is and errors.As still
// see both.
func joinDistinct(a, b error) error {
	if a == nil || b == nil {
		return errors.Join(a, b)
	}
	said := a.Error()
	lines := strings.Split(said, "\n")
	for _, l := range strings.Split(b.Error(), "\n") {
		// Validate's problems follow "invalid configuration: ", several
		// on one line in a's case.
		problem := l
		if i := strings.LastIndex(l, invalidConfiguration); i >= 0 {
			problem = l[i+len(invalidConfiguration):]
		}
		if !strings.Contains(said, problem) {
			lines = append(lines, l)
		}
	}
	return joined{text: strings.Join(lines, "\n"), errs: []error{a, b}}
}

// invalidConfiguration is what ErrInvalidConfig says, before the problems.
var invalidConfiguration = strings.TrimPrefix(ErrInvalidConfig.Error(), "pgoutbox: ") + ": "

// joined is errors shown as the text given.
type joined struct {
	text string
	errs []error
}

func (j joined) Error() string   { return j.text }
func (j joined) Unwrap() []error { return j.errs }
