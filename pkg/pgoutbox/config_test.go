package pgoutbox

import (
	"context"
	"math"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

func TestSubscriberConfigDefaults(t *testing.T) {
	t.Parallel()

	var zero SubscriberConfig
	require.NoError(t, zero.Validate(), "the zero config is usable")

	c := SubscriberConfig{}
	c.setDefaults()
	require.Equal(t, 1, c.MaxInFlight)
	require.Equal(t, 30*time.Second, c.Lease)
	require.Equal(t, 100*time.Millisecond, c.MinPollInterval)
	require.Equal(t, 5*time.Second, c.MaxPollInterval)
	require.Equal(t, 10*time.Second, c.StatementTimeout)
	require.Equal(t, 10*time.Second, c.DrainTimeout)
	require.Equal(t, 30*time.Second, c.AckDeadline)
	require.Equal(t, 0, c.MaxDeliveries)
	require.False(t, c.AutoInitializeSchema)
	require.NotNil(t, c.RetryPolicy)
	require.Equal(t, schema.Config{Schema: "public", Table: "outbox", DeadLetterTable: "outbox_dlq"}, c.Tables)

	host, err := os.Hostname()
	require.NoError(t, err)
	re := regexp.MustCompile(`^` + regexp.QuoteMeta(host) + `:` + strconv.Itoa(os.Getpid()) + `:[0-9a-f]{8}$`)
	require.Regexp(t, re, c.WorkerID)

	other := SubscriberConfig{}
	other.setDefaults()
	require.NotEqual(t, c.WorkerID, other.WorkerID, "two subscribers of one process get distinct worker ids")
}

func TestSubscriberConfigDefaultsFollowSetFields(t *testing.T) {
	t.Parallel()

	// A short lease pulls the default statement timeout under Lease/2.
	c := SubscriberConfig{Lease: 8 * time.Second, MaxPollInterval: time.Second}
	c.setDefaults()
	require.Less(t, c.StatementTimeout, 4*time.Second)
	require.NoError(t, c.Validate())

	// A large MinPollInterval raises the default MaxPollInterval with it.
	c = SubscriberConfig{MinPollInterval: 7 * time.Second}
	c.setDefaults()
	require.Equal(t, 7*time.Second, c.MaxPollInterval)
	require.NoError(t, c.Validate())

	// Set values are kept.
	c = SubscriberConfig{MaxInFlight: 4, WorkerID: "me", DrainTimeout: -1}
	c.setDefaults()
	require.Equal(t, 4, c.MaxInFlight)
	require.Equal(t, "me", c.WorkerID)
	require.Equal(t, time.Duration(-1), c.DrainTimeout)
	require.NoError(t, c.Validate())
}

func TestSubscriberConfigValidateRefusesFootguns(t *testing.T) {
	t.Parallel()

	for name, tc := range map[string]struct {
		cfg  SubscriberConfig
		want []string // fragments of the one problem, naming the constraint
	}{
		"LeaseNotLongerThanMaxPollInterval": {
			cfg:  SubscriberConfig{Lease: 5 * time.Second, MaxPollInterval: 5 * time.Second},
			want: []string{"Lease (5s) must be longer than MaxPollInterval (5s)", "raise Lease"},
		},
		"MinPollIntervalAboveMax": {
			cfg:  SubscriberConfig{MinPollInterval: 2 * time.Second, MaxPollInterval: time.Second},
			want: []string{"MinPollInterval (2s) is greater than MaxPollInterval (1s)"},
		},
		"MaxInFlightBelowOne": {
			cfg:  SubscriberConfig{MaxInFlight: -1},
			want: []string{"MaxInFlight is -1", "at least 1"},
		},
		"MaxInFlightAboveItsMaximum": {
			cfg:  SubscriberConfig{MaxInFlight: 1 << 30},
			want: []string{"MaxInFlight is 1073741824", "at most 65536"},
		},
		"LeaseOverflowing": {
			cfg:  SubscriberConfig{Lease: math.MaxInt64},
			want: []string{"Lease is 2562047h47m16.854775807s", "at most 8760h0m0s"},
		},
		"StatementTimeoutOverPostgresLimit": {
			cfg:  SubscriberConfig{Lease: MaxLease, StatementTimeout: 30 * 24 * time.Hour},
			want: []string{"StatementTimeout is 720h0m0s", "PostgreSQL's limit"},
		},
		"NilRetryPolicyFunc": {
			cfg:  SubscriberConfig{RetryPolicy: RetryPolicyFunc(nil)},
			want: []string{"RetryPolicy is a nil pgoutbox.RetryPolicyFunc", "leave RetryPolicy nil for the default"},
		},
		"NilExponentialBackoff": {
			cfg:  SubscriberConfig{RetryPolicy: (*ExponentialBackoff)(nil)},
			want: []string{"RetryPolicy is a nil *pgoutbox.ExponentialBackoff"},
		},
		"StatementTimeoutNotBelowHalfLease": {
			cfg:  SubscriberConfig{Lease: 30 * time.Second, StatementTimeout: 15 * time.Second},
			want: []string{"StatementTimeout (15s) must be shorter than Lease/2 (15s)"},
		},
		"BadTableName": {
			cfg:  SubscriberConfig{Tables: schema.Config{Table: "bad name"}},
			want: []string{`"bad name"`, "not a valid identifier"},
		},
		"BadDeadLetterTableName": {
			cfg:  SubscriberConfig{Tables: schema.Config{DeadLetterTable: "1dlq"}},
			want: []string{`"1dlq"`, "not a valid identifier"},
		},
		"DeadLetterTableNamedLikeTheOutboxsOwn": {
			cfg:  SubscriberConfig{Tables: schema.Config{Table: "jobs", DeadLetterTable: "jobs_paused"}},
			want: []string{`dead-letter table "jobs_paused" is the outbox "jobs"'s paused table`},
		},
		"NegativeMaxDeliveries": {
			cfg:  SubscriberConfig{MaxDeliveries: -3},
			want: []string{"MaxDeliveries is -3", "0 for no limit"},
		},
		"NegativeDrainTimeoutOtherThanMinusOne": {
			cfg:  SubscriberConfig{DrainTimeout: -time.Second},
			want: []string{"DrainTimeout is -1s", "-1"},
		},
		"LeaseTooShort": {
			cfg:  SubscriberConfig{Lease: 500 * time.Millisecond, MaxPollInterval: 100 * time.Millisecond},
			want: []string{"Lease is 500ms", "at least 1s"},
		},
		"ExponentialBackoffShrinking": {
			cfg:  SubscriberConfig{RetryPolicy: ExponentialBackoff{Multiplier: 0.5}},
			want: []string{"RetryPolicy: ExponentialBackoff.Multiplier is 0.5", "use 1 or more"},
		},
		"ExponentialBackoffJitterAboveOne": {
			cfg:  SubscriberConfig{RetryPolicy: &ExponentialBackoff{Jitter: 3}},
			want: []string{"RetryPolicy: ExponentialBackoff.Jitter is 3", "from 0 to 1", "NoJitter (-1)"},
		},
		"ExponentialBackoffNegativeJitter": {
			cfg:  SubscriberConfig{RetryPolicy: ExponentialBackoff{Jitter: -0.5}},
			want: []string{"RetryPolicy: ExponentialBackoff.Jitter is -0.5"},
		},
		"ExponentialBackoffCapBelowStart": {
			cfg:  SubscriberConfig{RetryPolicy: ExponentialBackoff{InitialInterval: time.Minute, MaxInterval: time.Second}},
			want: []string{"RetryPolicy: ExponentialBackoff.MaxInterval is 1s", "at least InitialInterval (1m0s)"},
		},
		"ConstantBackoffNegativeDelay": {
			cfg:  SubscriberConfig{RetryPolicy: ConstantBackoff{Delay: -time.Second}},
			want: []string{"RetryPolicy: ConstantBackoff.Delay is -1s"},
		},
		"AckDeadlineInNanoseconds": {
			cfg:  SubscriberConfig{AckDeadline: 30},
			want: []string{"AckDeadline is 30ns", "at least 1ms", "write 30 * time.Second"},
		},
		"StatementTimeoutInNanoseconds": {
			cfg:  SubscriberConfig{StatementTimeout: 10},
			want: []string{"StatementTimeout is 10ns", "at least 1ms"},
		},
		"PollIntervalInNanoseconds": {
			cfg:  SubscriberConfig{MinPollInterval: 1},
			want: []string{"MinPollInterval is 1ns", "at least 1ms"},
		},
		"ConstantBackoffAttemptsBelowMinusOne": {
			cfg:  SubscriberConfig{RetryPolicy: ConstantBackoff{MaxAttempts: -2}},
			want: []string{"RetryPolicy: ConstantBackoff.MaxAttempts is -2", "RetryForever (-1)"},
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			err := tc.cfg.Validate()
			require.ErrorIs(t, err, ErrInvalidConfig)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.Equal(t, 1, countProblems(err), "only the broken constraint is reported: %v", err)
		})
	}
}

// constraints are phrases, one per check of SubscriberConfig.Validate, that
// identify which checks an error reports.
var constraints = []string{
	"invalid table or schema name",
	"MaxInFlight is",
	"Lease is",
	"is greater than MaxPollInterval",
	"must be longer than MaxPollInterval",
	"StatementTimeout is",
	"must be shorter than Lease/2",
	"MaxDeliveries is",
	"DrainTimeout is",
	"RetryPolicy:",
	"RetryPolicy is a nil",
	"AckDeadline is",
	"PollInterval is",
}

// countProblems counts the checks a Validate error reports.
func countProblems(err error) int {
	n := 0
	for _, c := range constraints {
		if strings.Contains(err.Error(), c) {
			n++
		}
	}
	return n
}

func TestSubscriberConfigValidateReportsAllProblemsAtOnce(t *testing.T) {
	t.Parallel()

	err := SubscriberConfig{
		Tables:           schema.Config{Table: "x\";drop"},
		MaxInFlight:      -1,
		Lease:            2 * time.Second,
		MinPollInterval:  4 * time.Second,
		MaxPollInterval:  3 * time.Second,
		StatementTimeout: time.Second,
		MaxDeliveries:    -1,
	}.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	msg := err.Error()
	for _, w := range []string{
		`table name "x\";drop"`,
		"MaxInFlight is -1",
		"MinPollInterval (4s) is greater than MaxPollInterval (3s)",
		"Lease (2s) must be longer than MaxPollInterval (3s)",
		"StatementTimeout (1s) must be shorter than Lease/2 (1s)",
		"MaxDeliveries is -1",
	} {
		require.Contains(t, msg, w)
	}
	require.Equal(t, 6, countProblems(err), msg)
	require.Equal(t, 1, strings.Count(msg, ErrInvalidConfig.Error()), "one error, not one per problem: %s", msg)
}

// The special values pass, and the defaults of retry policies too.
func TestSubscriberConfigValidateAcceptsSpecialValues(t *testing.T) {
	t.Parallel()
	for _, c := range []SubscriberConfig{
		{DrainTimeout: NoDrain, AckDeadline: NoAckDeadline},
		{RetryPolicy: ExponentialBackoff{}},
		{RetryPolicy: ExponentialBackoff{MaxAttempts: RetryForever, Jitter: NoJitter, Multiplier: 1}},
		{RetryPolicy: ConstantBackoff{MaxAttempts: RetryForever}},
		{RetryPolicy: NoRetry()},
	} {
		require.NoError(t, c.Validate(), "%+v", c)
	}
	require.NoError(t, PublisherConfig{NotifyCooldown: NotifyEveryPublish, MaxPayloadBytes: NoPayloadLimit}.Validate())
}

// An error names "pgoutbox:" once, however many pgoutbox errors it wraps.
func TestErrorsNamePgoutboxOnce(t *testing.T) {
	t.Parallel()
	_, envErr := subscriberConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_TABLE": "bad name"}))
	for _, err := range []error{
		PublisherConfig{Tables: schema.Config{Table: "bad name"}}.Validate(),
		SubscriberConfig{Tables: schema.Config{Table: "bad name"}, ConsumerGroup: "a\x01"}.Validate(),
		SubscriberConfig{ConsumerGroup: "g", StartFrom: "oldest"}.Validate(),
		payloadTooLarge(0, 2<<20, 1<<20),
		envErr,
	} {
		require.Error(t, err)
		require.Equal(t, 1, strings.Count(err.Error(), "pgoutbox:"), err.Error())
		require.True(t, strings.HasPrefix(err.Error(), "pgoutbox: "), err.Error())
	}
	err := payloadTooLarge(0, 2<<20, 1<<20)
	require.ErrorIs(t, err, ErrInvalidMessage)
	require.ErrorIs(t, err, ErrPayloadTooLarge)
	require.Contains(t, err.Error(), "pgoutbox: invalid message: payload too large: message 0")
}

func TestPublisherConfigValidate(t *testing.T) {
	t.Parallel()

	require.NoError(t, PublisherConfig{}.Validate())

	c := PublisherConfig{}
	c.setDefaults()
	require.Equal(t, schema.Config{Schema: "public", Table: "outbox", DeadLetterTable: "outbox_dlq"}, c.Tables)

	err := PublisherConfig{Tables: schema.Config{Schema: "1abc"}}.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), `schema name "1abc"`)

	// Every problem at once, as SubscriberConfig's.
	err = PublisherConfig{Tables: schema.Config{Schema: "1abc"}, StatementTimeout: -time.Second, NotifyCooldown: -5 * time.Millisecond, MaxPayloadBytes: -2}.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorIs(t, err, schema.ErrInvalidName)
	for _, want := range []string{`schema name "1abc"`, "StatementTimeout is -1s", "NotifyCooldown is -5ms", "MaxPayloadBytes is -2"} {
		require.Contains(t, err.Error(), want)
	}
	_, err = NewPublisher(tx.FromPgxPool(nil), PublisherConfig{StatementTimeout: -time.Second, MaxPayloadBytes: -2}, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), "StatementTimeout is -1s; use a positive duration; MaxPayloadBytes is -2")

	// Over PostgreSQL's statement_timeout (math.MaxInt64 overflowed the
	// pool wait into "no connection of the pool came free").
	for _, d := range []time.Duration{30 * 24 * time.Hour, math.MaxInt64} {
		err = PublisherConfig{StatementTimeout: d}.Validate()
		require.ErrorIs(t, err, ErrInvalidConfig)
		require.Contains(t, err.Error(), "PostgreSQL's limit for statement_timeout")
	}
	require.NoError(t, PublisherConfig{StatementTimeout: MaxStatementTimeout}.Validate())
	err = PublisherConfig{StatementTimeout: 1}.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), "StatementTimeout is 1ns; it must be at least 1ms")
	require.NoError(t, PublisherConfig{StatementTimeout: MinDuration}.Validate())
	// NewPublisher refuses what Validate refuses: a pool publisher built
	// with 10ns failed every Publish, blaming the pool.
	for d, want := range map[time.Duration]string{10: "StatementTimeout is 10ns; it must be at least 1ms", 1000 * time.Hour: "PostgreSQL's limit for statement_timeout"} {
		_, err = NewPublisher(tx.FromPgxPool(nil), PublisherConfig{StatementTimeout: d}, nil)
		require.ErrorIs(t, err, ErrInvalidConfig)
		require.Contains(t, err.Error(), want)
	}
	_, err = NewPublisher(tx.FromPgxPool(nil), PublisherConfig{StatementTimeout: MinDuration}, nil)
	require.NoError(t, err)
}

// NewSubscriber reports only the values its caller set, as Validate does:
// not a default derived from an invalid one (StatementTimeout from Lease).
func TestNewSubscriberNamesOnlyTheValuesSet(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none") // never connects
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = NewSubscriber(pool, SubscriberConfig{Lease: -time.Second}, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), "Lease is -1s")
	require.NotContains(t, err.Error(), "StatementTimeout", "a default derived from the invalid Lease")
	require.Equal(t, SubscriberConfig{Lease: -time.Second}.Validate().Error(), err.Error())
}

func TestClaimModeParsesItsNamesAndRejectsOthers(t *testing.T) {
	t.Parallel()
	for _, m := range []ClaimMode{ClaimAuto, ClaimLease, ClaimHeld} {
		got, err := ParseClaimMode(strings.ToUpper(m.String()))
		require.NoError(t, err)
		require.Equal(t, m, got)
	}
	_, err := ParseClaimMode("fast")
	require.ErrorContains(t, err, "use auto, lease or held")
	err = SubscriberConfig{ClaimMode: ClaimMode(7)}.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "ClaimMode is 7; use ClaimAuto, ClaimLease or ClaimHeld")
}
