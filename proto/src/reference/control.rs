//! `egressproxy.reference.v1.ControlService`: the reference provider's fault injection
//! and state forcing over gRPC, so tests (and grpcurl users) can drive a provider that
//! runs as a separate process.

use std::time::Duration;

use tonic::{Request, Response, Status};

use super::{Fault, FaultEffect, MemoryProvider};
use crate::ErrorClass;
use crate::pb::reference::v1 as control;
use crate::pb::{InstanceState, provider::v1 as contract};

/// The control service of one [`MemoryProvider`].
#[derive(Debug, Clone)]
pub struct ControlService {
    provider: MemoryProvider,
}

impl ControlService {
    /// Controls `provider` (a clone sharing its state).
    pub fn new(provider: MemoryProvider) -> Self {
        ControlService { provider }
    }

    /// The service ready to add to a server.
    pub fn into_server(self) -> control::control_service_server::ControlServiceServer<Self> {
        control::control_service_server::ControlServiceServer::new(self)
    }
}

fn error_class(class: control::ErrorClass) -> Result<ErrorClass, Status> {
    Ok(match class {
        control::ErrorClass::Unspecified => {
            return Err(Status::invalid_argument("fail: choose an error class"));
        }
        control::ErrorClass::Transient => ErrorClass::Transient,
        control::ErrorClass::DeadlineExceeded => ErrorClass::DeadlineExceeded,
        control::ErrorClass::Permanent => ErrorClass::Permanent,
        control::ErrorClass::InvalidArgument => ErrorClass::InvalidArgument,
        control::ErrorClass::NotFound => ErrorClass::NotFound,
        control::ErrorClass::AlreadyExists => ErrorClass::AlreadyExists,
        control::ErrorClass::QuotaExhausted => ErrorClass::QuotaExhausted,
        control::ErrorClass::Unimplemented => ErrorClass::Unimplemented,
    })
}

#[tonic::async_trait]
impl control::control_service_server::ControlService for ControlService {
    async fn inject_fault(
        &self,
        request: Request<control::InjectFaultRequest>,
    ) -> Result<Response<control::InjectFaultResponse>, Status> {
        use control::inject_fault_request::Effect;
        let request = request.into_inner();
        let effect = match request.effect {
            None => {
                return Err(Status::invalid_argument(
                    "effect: set fail, latency or hang",
                ));
            }
            Some(Effect::Fail(class)) => {
                let class = control::ErrorClass::try_from(class)
                    .map_err(|_| Status::invalid_argument("fail: unknown error class"))?;
                FaultEffect::Fail(error_class(class)?)
            }
            Some(Effect::Latency(latency)) => FaultEffect::Latency(
                latency
                    .try_into()
                    .map_err(|_| Status::invalid_argument("latency: must not be negative"))?,
            ),
            Some(Effect::Hang(true)) => FaultEffect::Hang,
            Some(Effect::DelayResponse(delay)) => {
                FaultEffect::DelayResponse(delay.try_into().map_err(|_| {
                    Status::invalid_argument("delay_response: must not be negative")
                })?)
            }
            Some(Effect::Hang(false)) => {
                return Err(Status::invalid_argument(
                    "hang: set to true, or choose another effect",
                ));
            }
        };
        let message = if request.message.is_empty() {
            "injected fault".into()
        } else {
            request.message
        };
        let retry_after = request
            .retry_after
            .map(Duration::try_from)
            .transpose()
            .map_err(|_| Status::invalid_argument("retry_after: must not be negative"))?;
        self.provider.faults().inject(Fault {
            method: Some(request.method).filter(|m| !m.is_empty()),
            remaining: request.count,
            effect,
            message,
            retry_after,
        });
        Ok(Response::new(control::InjectFaultResponse {}))
    }

    async fn clear_faults(
        &self,
        _request: Request<control::ClearFaultsRequest>,
    ) -> Result<Response<control::ClearFaultsResponse>, Status> {
        self.provider.faults().clear();
        Ok(Response::new(control::ClearFaultsResponse {}))
    }

    async fn set_instance_state(
        &self,
        request: Request<control::SetInstanceStateRequest>,
    ) -> Result<Response<control::SetInstanceStateResponse>, Status> {
        let request = request.into_inner();
        let state = match contract::InstanceState::try_from(request.state) {
            Ok(InstanceState::Unspecified) => None,
            Ok(state) => Some(state),
            Err(_) => return Err(Status::invalid_argument("state: unknown instance state")),
        };
        self.provider.set_state(&request.id, state)?;
        Ok(Response::new(control::SetInstanceStateResponse {}))
    }

    async fn get_call_counts(
        &self,
        _request: Request<control::GetCallCountsRequest>,
    ) -> Result<Response<control::GetCallCountsResponse>, Status> {
        Ok(Response::new(control::GetCallCountsResponse {
            counts: self.provider.call_counts().into_iter().collect(),
        }))
    }
}
