package lease

import (
	"strings"
	"testing"
	"time"
)

func TestConfigValidateNamesTheField(t *testing.T) {
	base := Config{Group: "g", MemberID: "m"}.WithDefaults()
	tests := []struct {
		field  string
		mutate func(*Config)
	}{
		{"Bucket", func(c *Config) { c.Bucket = "bad.name" }},
		{"TTL", func(c *Config) { c.TTL = 500 * time.Millisecond }},
		{"SafetyMargin", func(c *Config) { c.SafetyMargin = c.TTL }},
		{"SafetyMargin", func(c *Config) { c.SafetyMargin = -time.Second }},
		{"Group", func(c *Config) { c.Group = "" }},
		{"MemberID", func(c *Config) { c.MemberID = "" }},
		{"RenewEvery", func(c *Config) { c.RenewEvery = 2 * time.Second }},
		{"RenewEvery", func(c *Config) { c.RenewEvery = -1 }},
		{"PollItemsEvery", func(c *Config) { c.PollItemsEvery = -1 }},
	}
	if err := base.validate(); err != nil {
		t.Fatalf("defaults do not validate: %v", err)
	}
	for _, tt := range tests {
		c := base
		tt.mutate(&c)
		err := c.validate()
		if err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("invalid %s: validate() = %v; want an error naming %s", tt.field, err, tt.field)
		}
	}
}

func TestConfigWithDefaults(t *testing.T) {
	c := Config{Group: "g"}.WithDefaults()
	if c.TTL != DefaultTTL || c.RenewEvery != DefaultRenewEvery || c.SafetyMargin != DefaultSafetyMargin ||
		c.Bucket != DefaultBucket || c.PollItemsEvery != DefaultPollItemsEvery || c.Logger == nil {
		t.Errorf("WithDefaults() = %+v", c)
	}
	if c.MemberID == "" || c.MemberID == (Config{Group: "g"}.WithDefaults()).MemberID {
		t.Errorf("default MemberID %q must be set and differ between calls", c.MemberID)
	}
}
